//! A working pool over real sockets on loopback: a real registrar (in-process thread or the
//! `rserpool` binary), pool elements through the library and as separate processes, pool users.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{BIN, fast_config, registrar, signal, spawn, wait_for};
use rserpool_wire::Message;

use rserpool_asap::{PoolElement, PoolElementConfig, PoolUser, PoolUserConfig};
use rserpool_registrar::Config;
use rserpool_wire::policy::load_from_fraction;
use rserpool_wire::{AsapMessage, CauseCode, Framer, Policy, PoolHandle};
use rustix::process::Signal;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn pe_config(reg: SocketAddr, pool: &str, port: u16, policy: Policy) -> PoolElementConfig {
    let mut cfg = PoolElementConfig::new(pool, SocketAddr::from(([127, 0, 0, 1], port)), policy);
    cfg.registrars = vec![reg];
    cfg.backoff_min = Duration::from_millis(50);
    cfg.backoff_max = Duration::from_millis(500);
    cfg
}

fn pe(reg: SocketAddr, pool: &str, port: u16, policy: Policy) -> PoolElement {
    PoolElement::start(pe_config(reg, pool, port, policy)).unwrap()
}

fn pool_user(reg: SocketAddr, items: Option<u32>) -> PoolUser {
    PoolUser::new(PoolUserConfig {
        registrars: vec![reg],
        items,
        ..PoolUserConfig::default()
    })
    .unwrap()
}

/// Two registered PEs of `pool`: the one pool users try first (priority 9) at `first_port`,
/// and one that accepts (priority 1; its listener comes with it).
async fn tried_first_and_good(
    reg: SocketAddr,
    pool: &str,
    first_port: u16,
) -> (PoolElement, PoolElement, tokio::net::TcpListener) {
    let up = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let first = pe(reg, pool, first_port, Policy::Priority { priority: 9 });
    let good = pe(
        reg,
        pool,
        up.local_addr().unwrap().port(),
        Policy::Priority { priority: 1 },
    );
    first.wait_registered(Duration::from_secs(5)).await.unwrap();
    good.wait_registered(Duration::from_secs(5)).await.unwrap();
    (first, good, up)
}

/// The PE IDs a fresh resolution returns (empty if the pool is unknown).
async fn resolve_ids(reg: SocketAddr, pool: &str, items: u32) -> Vec<u32> {
    let mut pu = pool_user(reg, Some(items));
    match pu.resolve(&PoolHandle::from(pool)).await {
        Ok(r) => r.pool_elements.iter().map(|p| p.id).collect(),
        Err(_) => Vec::new(),
    }
}

/// Runs the `rserpool` binary to completion off the test's runtime: the pool elements of
/// these tests run on that (single-threaded) runtime and must keep answering keep-alives
/// (300 ms in `fast_config`) while the command runs.
async fn run_bin(args: &[&str]) -> std::process::Output {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    tokio::task::spawn_blocking(move || Command::new(BIN).args(&args).output())
        .await
        .expect("command thread")
        .expect("spawn rserpool")
}

/// A pool user that knows one registrar rides over that registrar's restart: the first
/// question after it (once the PE has registered again) is answered. Its association kept
/// from before is found closed when the question goes out; it is replaced, not counted as the
/// registrar failing the question (with no other registrar, that failed it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_user_with_one_registrar_rides_over_its_restart() {
    let asap: SocketAddr = format!("127.0.0.1:{}", common::free_port())
        .parse()
        .unwrap();
    let config = || Config {
        asap: asap.to_string().parse().unwrap(),
        ..common::local_config()
    };
    let reg = registrar(config());
    let _pe = pe(asap, "Restart", common::free_port(), Policy::RoundRobin);
    let handle = PoolHandle::from("Restart");
    let mut pu = pool_user(asap, None);
    let registered = || async { resolve_ids(asap, "Restart", 10).await.len() == 1 };
    wait_for(Duration::from_secs(10), "the PE registers", registered).await;
    assert_eq!(pu.pool_elements(&handle).await.unwrap().1.len(), 1);
    reg.stop();
    let _reg = registrar(config());
    wait_for(
        Duration::from_secs(10),
        "the PE registers again",
        registered,
    )
    .await;
    let again = pu.pool_elements(&handle).await;
    assert!(
        again.is_ok(),
        "the first question after the restart: {again:?}"
    );
}

#[tokio::test]
async fn register_then_resolve_and_deregister() {
    let r = registrar(fast_config());
    let a = pe(r.asap_addr(), "P", 7001, Policy::RoundRobin);
    a.wait_registered(Duration::from_secs(5)).await.unwrap();
    let mut pu = pool_user(r.asap_addr(), None);
    let res = pu.resolve(&PoolHandle::from("P")).await.unwrap();
    assert_eq!(res.pool_elements.len(), 1);
    let e = &res.pool_elements[0];
    assert_eq!(e.id, a.id());
    assert_eq!(e.home_registrar, r.server_id());
    assert_eq!(e.user_transport.to_string(), "tcp 127.0.0.1:7001");
    assert!(matches!(res.policy, Some(Policy::RoundRobin)));
    // Unknown pool: cause 9.
    let err = pu.resolve(&PoolHandle::from("nope")).await.unwrap_err();
    assert!(matches!(err, rserpool_asap::Error::UnknownPool(_)), "{err}");
    a.stop().await;
    wait_for(Duration::from_secs(2), "deregistration", || async {
        resolve_ids(r.asap_addr(), "P", 3).await.is_empty()
    })
    .await;
}

#[tokio::test]
async fn every_policy_through_the_registrar() {
    let r = registrar(fast_config());
    let reg = r.asap_addr();
    let load = |f: f64| load_from_fraction(f);
    // Deterministic policies: the order of one resolution of all PEs.
    let cases: Vec<(&str, Vec<Policy>, Vec<usize>)> = vec![
        (
            "lu",
            vec![
                Policy::LeastUsed { load: load(0.5) },
                Policy::LeastUsed { load: load(0.1) },
                Policy::LeastUsed { load: load(0.3) },
            ],
            vec![1, 2, 0],
        ),
        (
            "plu",
            vec![
                Policy::PriorityLeastUsed {
                    load: load(0.2),
                    degradation: load(0.5),
                },
                Policy::PriorityLeastUsed {
                    load: load(0.4),
                    degradation: 0,
                },
                Policy::PriorityLeastUsed {
                    load: load(0.1),
                    degradation: 0,
                },
            ],
            vec![2, 1, 0],
        ),
        (
            "lud",
            vec![
                Policy::LeastUsedDegradation {
                    load: load(0.9),
                    degradation: load(0.01),
                },
                Policy::LeastUsedDegradation {
                    load: load(0.2),
                    degradation: load(0.01),
                },
                Policy::LeastUsedDegradation {
                    load: load(0.6),
                    degradation: load(0.01),
                },
            ],
            vec![1, 2, 0],
        ),
        (
            "prio",
            vec![
                Policy::Priority { priority: 1 },
                Policy::Priority { priority: 9 },
                Policy::Priority { priority: 5 },
            ],
            vec![1, 2, 0],
        ),
    ];
    for (name, policies, order) in cases {
        let pes: Vec<PoolElement> = policies
            .into_iter()
            .enumerate()
            .map(|(i, p)| pe(reg, name, 7100 + i as u16, p))
            .collect();
        for p in &pes {
            p.wait_registered(Duration::from_secs(5)).await.unwrap();
        }
        let want: Vec<u32> = order.iter().map(|&i| pes[i].id()).collect();
        assert_eq!(resolve_ids(reg, name, 3).await, want, "policy {name}");
    }

    // Round robin: three single-PE resolutions visit every PE once, in a fixed cycle.
    let rr: Vec<PoolElement> = (0..3)
        .map(|i| pe(reg, "rr", 7200 + i, Policy::RoundRobin))
        .collect();
    for p in &rr {
        p.wait_registered(Duration::from_secs(5)).await.unwrap();
    }
    let mut pu = pool_user(reg, Some(1));
    let mut seen = Vec::new();
    for _ in 0..6 {
        let res = pu.resolve(&PoolHandle::from("rr")).await.unwrap();
        seen.push(res.pool_elements[0].id);
    }
    let mut first: Vec<u32> = seen[..3].to_vec();
    first.sort();
    let mut ids: Vec<u32> = rr.iter().map(PoolElement::id).collect();
    ids.sort();
    assert_eq!(first, ids, "rr visits each PE once per round");
    assert_eq!(seen[..3], seen[3..], "rr repeats its cycle");

    // Weighted and random policies: the distribution of many single-PE resolutions.
    let dist = |name: &'static str, policies: Vec<Policy>| async move {
        let pes: Vec<PoolElement> = policies
            .into_iter()
            .enumerate()
            .map(|(i, p)| pe(reg, name, 7300 + i as u16, p))
            .collect();
        for p in &pes {
            p.wait_registered(Duration::from_secs(5)).await.unwrap();
        }
        let mut pu = pool_user(reg, Some(1));
        let mut counts: HashMap<u32, u32> = HashMap::new();
        for _ in 0..600 {
            let res = pu.resolve(&PoolHandle::from(name)).await.unwrap();
            *counts.entry(res.pool_elements[0].id).or_default() += 1;
        }
        let out: Vec<u32> = pes
            .iter()
            .map(|p| counts.get(&p.id()).copied().unwrap_or(0))
            .collect();
        drop(pes);
        out
    };
    let wrr = dist(
        "wrr",
        vec![
            Policy::WeightedRoundRobin { weight: 1 },
            Policy::WeightedRoundRobin { weight: 2 },
            Policy::WeightedRoundRobin { weight: 3 },
        ],
    )
    .await;
    assert_eq!(wrr, vec![100, 200, 300], "wrr is exact over whole rounds");
    let rand = dist("rand", vec![Policy::Random, Policy::Random, Policy::Random]).await;
    assert!(
        rand.iter().all(|&c| (140..=260).contains(&c)),
        "rand roughly uniform: {rand:?}"
    );
    let wrand = dist(
        "wrand",
        vec![
            Policy::WeightedRandom { weight: 1 },
            Policy::WeightedRandom { weight: 5 },
        ],
    )
    .await;
    assert!(
        (50..=150).contains(&wrand[0]),
        "wrand 1:5 → about 100 of 600: {wrand:?}"
    );
    let rlu = dist(
        "rlu",
        vec![
            Policy::RandomizedLeastUsed { load: load(0.8) },
            Policy::RandomizedLeastUsed { load: load(0.2) },
        ],
    )
    .await;
    // Weights 0.2 : 0.8 of free capacity → about 120 : 480.
    assert!(
        (60..=190).contains(&rlu[0]),
        "rlu favours the less loaded PE: {rlu:?}"
    );
}

/// Waits until the PE's registration is refused (what `wait_registered` tells); returns the
/// reason.
async fn rejection(pe: &PoolElement) -> String {
    match pe.wait_registered(Duration::from_secs(5)).await {
        Err(rserpool_asap::Error::RegistrationRefused(why)) => why,
        other => panic!("not refused within 5 s: {other:?}"),
    }
}

#[tokio::test]
async fn inconsistent_policy_is_rejected_with_its_cause() {
    let r = registrar(fast_config());
    let a = pe(r.asap_addr(), "mixed", 7400, Policy::RoundRobin);
    a.wait_registered(Duration::from_secs(5)).await.unwrap();
    let b = pe(r.asap_addr(), "mixed", 7401, Policy::LeastUsed { load: 0 });
    let why = rejection(&b).await;
    assert!(why.contains("Inconsistent Pooling Policy"), "{why}");
    // A load is for a policy that carries one.
    assert!(!a.update_load(0.5), "round robin took a load");
    assert!(b.update_load(0.5));
}

#[tokio::test]
async fn killed_pe_process_disappears() {
    let r = registrar(fast_config());
    let reg = r.asap_addr().to_string();
    let mut ids = Vec::new();
    let mut children = Vec::new();
    for (i, id) in ["0x1001", "0x1002"].iter().enumerate() {
        children.push(spawn(&[
            "example",
            "echo",
            "--pool",
            "K",
            "--policy",
            "lu",
            "--id",
            id,
            "--registrar",
            &reg,
        ]));
        ids.push(0x1001 + i as u32);
    }
    wait_for(
        Duration::from_secs(10),
        "both PE processes registered",
        || async { resolve_ids(r.asap_addr(), "K", 3).await.len() == 2 },
    )
    .await;
    // SIGKILL: the kernel closes its association, the registrar removes it at once.
    signal(&children[0].0, Signal::KILL);
    let t = wait_for(Duration::from_secs(2), "killed PE gone", || async {
        !resolve_ids(r.asap_addr(), "K", 3).await.contains(&ids[0])
    })
    .await;
    eprintln!("SIGKILLed PE gone after {t:?}");
    // SIGSTOP: the association stays open but keep-alives go unanswered.
    signal(&children[1].0, Signal::STOP);
    let t = wait_for(
        Duration::from_millis(300 + 300 + 400),
        "stopped PE gone (keep-alive timeout)",
        || async { resolve_ids(r.asap_addr(), "K", 3).await.is_empty() },
    )
    .await;
    eprintln!("SIGSTOPped PE gone after {t:?} (interval 300 ms + timeout 300 ms)");
    signal(&children[1].0, Signal::KILL);
}

#[tokio::test]
async fn serve_follows_its_target() {
    let r = registrar(fast_config());
    let target = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let taddr = target.local_addr().unwrap();
    let reg = r.asap_addr().to_string();
    let _serve = spawn(&[
        "serve",
        "--pool",
        "S",
        "--target",
        &taddr.to_string(),
        "--registrar",
        &reg,
        "--check-interval-ms",
        "100",
        "--fall",
        "1",
        "--id",
        "0x5e",
        "--policy",
        "lu",
    ]);
    wait_for(Duration::from_secs(10), "serve registers", || async {
        resolve_ids(r.asap_addr(), "S", 3).await == vec![0x5e]
    })
    .await;
    drop(target);
    wait_for(
        Duration::from_secs(5),
        "serve deregisters when the target stops",
        || async { resolve_ids(r.asap_addr(), "S", 3).await.is_empty() },
    )
    .await;
    let _target = tokio::net::TcpListener::bind(taddr).await.unwrap();
    wait_for(
        Duration::from_secs(5),
        "serve re-registers when the target is back",
        || async { resolve_ids(r.asap_addr(), "S", 3).await == vec![0x5e] },
    )
    .await;
}

/// False reports (RFC 5355 §3.6): a PE whose service answers stays, whoever reports it and
/// however often; the registrar checks the service itself at the threshold.
#[tokio::test]
async fn unreachable_reports_about_a_pe_whose_service_answers_do_not_remove_it() {
    let r = registrar(Config {
        max_bad_pe_reports: 3,
        ..fast_config()
    });
    let service = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = service.local_addr().unwrap().port();
    let live = pe(r.asap_addr(), "F", port, Policy::RoundRobin);
    live.wait_registered(Duration::from_secs(5)).await.unwrap();
    let h = PoolHandle::from("F");
    // Three reports from one pool user, then one from each of three.
    let status = r.status_addr().unwrap();
    let refuted = |n: u64| async move {
        wait_for(
            Duration::from_secs(5),
            "the reports refuted",
            || async move {
                common::registrar_status(status)
                    .await
                    .is_some_and(|s| s.counters.unreachable_refuted >= n)
            },
        )
        .await;
    };
    let mut pu = pool_user(r.asap_addr(), None);
    for _ in 0..3 {
        pu.report_unreachable(&h, live.id()).await.unwrap();
    }
    refuted(1).await;
    // A refutation forgets the reports: three more are needed, here from three pool users.
    for _ in 0..3 {
        pool_user(r.asap_addr(), None)
            .report_unreachable(&h, live.id())
            .await
            .unwrap();
    }
    refuted(2).await;
    assert_eq!(resolve_ids(r.asap_addr(), "F", 3).await, vec![live.id()]);
    drop(service);
}

/// A PE whose service does not answer (nothing listens on its port) goes at the threshold.
#[tokio::test]
async fn unreachable_reports_remove_a_pe_at_the_threshold() {
    let r = registrar(Config {
        max_bad_pe_reports: 3,
        ..fast_config()
    });
    let a = pe(r.asap_addr(), "U", 7500, Policy::RoundRobin);
    let b = pe(r.asap_addr(), "U", 7501, Policy::RoundRobin);
    a.wait_registered(Duration::from_secs(5)).await.unwrap();
    b.wait_registered(Duration::from_secs(5)).await.unwrap();
    let mut pu = pool_user(r.asap_addr(), None);
    let h = PoolHandle::from("U");
    for _ in 0..2 {
        pu.report_unreachable(&h, a.id()).await.unwrap();
    }
    // Two reports: probed, answered, still there.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut ids = resolve_ids(r.asap_addr(), "U", 3).await;
    ids.sort();
    let mut both = vec![a.id(), b.id()];
    both.sort();
    assert_eq!(ids, both);
    pu.report_unreachable(&h, a.id()).await.unwrap();
    wait_for(
        Duration::from_secs(2),
        "third report removes the PE",
        || async { resolve_ids(r.asap_addr(), "U", 3).await == vec![b.id()] },
    )
    .await;
}

#[tokio::test]
async fn pool_user_connect_fails_over_and_reports() {
    let r = registrar(Config {
        max_bad_pe_reports: 1,
        ..fast_config()
    });
    // One PE whose service is down (nothing listens), one that accepts.
    let dead_port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let (_dead, good, _up) = tried_first_and_good(r.asap_addr(), "C", dead_port).await;
    let mut pu = pool_user(r.asap_addr(), None);
    let (_s, reached) = pu.connect(&PoolHandle::from("C")).await.unwrap();
    assert_eq!(reached.id, good.id());
    wait_for(
        Duration::from_secs(2),
        "the dead PE reported and removed",
        || async { resolve_ids(r.asap_addr(), "C", 3).await == vec![good.id()] },
    )
    .await;
}

/// A pool user that many tasks share waits for a PE's connect without holding up the others:
/// while one task's connect waits on a PE whose accept queue is full (its SYNs go unanswered),
/// another task's resolution is answered, and the first task fails over to the PE that
/// answers. With the pool user behind one lock held across the connect, the second task would
/// wait out the first's connect timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_pool_user_connects_without_holding_up_other_tasks() {
    let r = registrar(fast_config());
    // A listener that never accepts, its queue filled: further SYNs are dropped.
    let full = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    full.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
        .unwrap();
    full.listen(0).unwrap();
    let full_addr = full.local_addr().unwrap().as_socket().unwrap();
    let mut fillers = Vec::new();
    while tokio::time::timeout(Duration::from_millis(300), TcpStream::connect(full_addr))
        .await
        .is_ok_and(|c| c.map(|c| fillers.push(c)).is_ok())
    {}
    let (_stuck, good, _up) = tried_first_and_good(r.asap_addr(), "Shared", full_addr.port()).await;
    let connect_timeout = Duration::from_secs(3);
    let pu = rserpool_asap::SharedPoolUser::new(PoolUserConfig {
        registrars: vec![r.asap_addr()],
        connect_timeout,
        ..PoolUserConfig::default()
    })
    .unwrap();
    let handle = PoolHandle::from("Shared");
    // The cache filled first, so that the connecting task holds no registrar question open.
    assert_eq!(pu.resolve(&handle).await.unwrap().pool_elements.len(), 2);
    let started = std::time::Instant::now();
    let connecting = tokio::spawn({
        let (pu, handle) = (pu.clone(), handle.clone());
        async move { pu.connect(&handle).await.map(|(_, pe)| pe.id) }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let other = pu.clone();
    let asked = std::time::Instant::now();
    let resolved = other.resolve(&handle).await.unwrap();
    let waited = asked.elapsed();
    assert!(
        waited < connect_timeout / 3,
        "a resolution waited {waited:?} behind another task's connect"
    );
    assert!(
        !connecting.is_finished(),
        "the first connect did not wait on the stuck PE"
    );
    assert_eq!(resolved.pool_elements.len(), 2);
    let reached = connecting.await.unwrap().unwrap();
    assert_eq!(
        reached,
        good.id(),
        "the connect failed over to the PE that answers"
    );
    assert!(
        started.elapsed() >= connect_timeout,
        "the stuck PE was tried first"
    );
}

/// A pool user that connects over TCP leaves a pool of PEs over SCTP alone: it cannot reach
/// them, which says nothing about them, so it does not report them unreachable (with the
/// registrar's threshold at one report, a report would take the live PE out of the pool for
/// everyone); its error says why.
#[tokio::test]
async fn a_tcp_pool_user_does_not_report_pes_over_sctp() {
    let r = registrar(Config {
        max_bad_pe_reports: 1,
        ..fast_config()
    });
    let mut cfg = pe_config(
        r.asap_addr(),
        "Sctp",
        common::free_port(),
        Policy::RoundRobin,
    );
    cfg.service_over_sctp = true;
    let sctp = PoolElement::start(cfg).unwrap();
    sctp.wait_registered(Duration::from_secs(5)).await.unwrap();
    let handle = PoolHandle::from("Sctp");
    let mut pu = pool_user(r.asap_addr(), None);
    match pu.connect(&handle).await {
        Err(rserpool_asap::Error::OtherTransport { transport, .. }) => {
            assert!(transport.starts_with("sctp"), "{transport}")
        }
        other => panic!(
            "expected OtherTransport, got {:?}",
            other.map(|(_, pe)| pe.id)
        ),
    }
    // Asked again (a retry loop would): still no report.
    for _ in 0..3 {
        assert!(pu.connect(&handle).await.is_err());
    }
    assert_eq!(
        resolve_ids(r.asap_addr(), "Sctp", 10).await,
        vec![sctp.id()],
        "the SCTP PE is still registered"
    );
}

/// `rserpool resolve` and `connect` over SCTP end their association before they exit (SHUTDOWN, SHUTDOWN ACK,
/// SHUTDOWN COMPLETE): the registrar's connection goes at once. Exiting first left the
/// registrar retransmitting into silence and counting the association for many seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resolve_over_sctp_ends_its_association_before_it_exits() {
    let udp = common::free_port();
    let sctp = format!("sctp+udp://127.0.0.1:3863?udp={udp}");
    let mut cfg = fast_config();
    cfg.asap = format!("127.0.0.1:0,{sctp}").parse().unwrap();
    let r = registrar(cfg);
    let status = r.status_addr().unwrap();
    let connections = || async move {
        common::registrar_status(status)
            .await
            .map_or(usize::MAX, |s| s.connections)
    };
    let before = connections().await;
    let out = run_bin(&["resolve", "--registrar", &sctp, "Nowhere"]).await;
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("unknown pool"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_for(
        Duration::from_secs(2),
        "the registrar's connection from resolve gone",
        || async { connections().await == before },
    )
    .await;
    // `connect` too, on its way out with an error.
    let out = run_bin(&["connect", "--registrar", &sctp, "Nowhere"]).await;
    assert!(!out.status.success());
    wait_for(
        Duration::from_secs(2),
        "the registrar's connection from connect gone",
        || async { connections().await == before },
    )
    .await;
}

async fn read_message(s: &mut TcpStream, framer: &mut Framer) -> Option<AsapMessage> {
    let read = async {
        loop {
            if let Ok(Some(m)) = framer.next_message() {
                return AsapMessage::decode(&m).ok();
            }
            let mut buf = [0u8; 4096];
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return None,
                Ok(n) => framer.extend(&buf[..n]),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(2), read)
        .await
        .ok()
        .flatten()
}

/// An ERROR message carrying `code`, or the connection closed.
async fn expect_error_or_close(s: &mut TcpStream, code: Option<CauseCode>) {
    let mut f = Framer::new(65535);
    match read_message(s, &mut f).await {
        None => {}
        Some(AsapMessage::Error { error }) => {
            if let Some(code) = code {
                assert_eq!(error.causes[0].code, code);
            }
        }
        Some(other) => panic!("expected ERROR or close, got {other:?}"),
    }
}

#[tokio::test]
async fn bad_input_gets_an_error_and_others_keep_being_served() {
    let r = registrar(fast_config());
    let reg = r.asap_addr();
    let a = pe(reg, "G", 7600, Policy::RoundRobin);
    a.wait_registered(Duration::from_secs(5)).await.unwrap();
    let mut pu = pool_user(reg, None);
    let h = PoolHandle::from("G");
    pu.resolve(&h).await.unwrap();

    // Garbage: an unknown message type with a plausible length.
    let mut s = TcpStream::connect(reg).await.unwrap();
    s.write_all(&[0x7f, 0, 0, 8, 1, 2, 3, 4]).await.unwrap();
    expect_error_or_close(&mut s, Some(CauseCode::UNRECOGNIZED_MESSAGE)).await;

    // A HANDLE_RESOLUTION whose pool handle parameter overruns the message.
    let mut s = TcpStream::connect(reg).await.unwrap();
    s.write_all(&[0x05, 0, 0, 12, 0, 9, 0, 40, b'G', 0, 0, 0])
        .await
        .unwrap();
    expect_error_or_close(&mut s, None).await;
    // The same connection (if open) still answers a valid resolution.
    let ok = AsapMessage::HandleResolution {
        subscribe: false,
        pool_handle: h.clone(),
        items: None,
    };
    if s.write_all(&ok.to_bytes().unwrap()).await.is_ok() {
        let mut f = Framer::new(65535);
        if let Some(m) = read_message(&mut s, &mut f).await {
            assert!(
                matches!(m, AsapMessage::HandleResolutionResponse { .. }),
                "{m:?}"
            );
        }
    }

    // Oversized: a length beyond the limit loses framing: ERROR, then close.
    let mut s = TcpStream::connect(reg).await.unwrap();
    s.write_all(&[0x01, 0, 0xff, 0xff, 0, 0, 0, 0])
        .await
        .unwrap();
    expect_error_or_close(&mut s, Some(CauseCode::INVALID_VALUES)).await;
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "connection closed after framing was lost");

    // Truncated: half a message, then the writer goes away.
    let mut s = TcpStream::connect(reg).await.unwrap();
    let full = ok.to_bytes().unwrap();
    s.write_all(&full[..full.len() / 2]).await.unwrap();
    drop(s);

    // Random bytes on many connections at once.
    for seed in 0..20u32 {
        let mut s = TcpStream::connect(reg).await.unwrap();
        let junk: Vec<u8> = (0..64u32)
            .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 97) >> 13) as u8)
            .collect();
        let _ = s.write_all(&junk).await;
    }

    // Everyone else is still served: the PE is registered, the PU resolves, a new PE registers.
    let res = pu.resolve(&h).await.unwrap();
    assert_eq!(res.pool_elements[0].id, a.id());
    let b = pe(reg, "G", 7601, Policy::RoundRobin);
    b.wait_registered(Duration::from_secs(5)).await.unwrap();
    assert_eq!(resolve_ids(reg, "G", 3).await.len(), 2);
}

#[tokio::test]
async fn pe_binding_defends_against_other_associations() {
    let r = registrar(fast_config());
    let reg = r.asap_addr();
    let a = pe(reg, "B", 7700, Policy::RoundRobin);
    a.wait_registered(Duration::from_secs(5)).await.unwrap();
    // Another association tries to deregister and to re-register the same PE ID.
    let mut s = rserpool_asap::AsapConnection::connect(reg, Duration::from_secs(1))
        .await
        .unwrap();
    s.send(&AsapMessage::Deregistration {
        pool_handle: PoolHandle::from("B"),
        pe_id: a.id(),
    })
    .await
    .unwrap();
    match s.recv().await.unwrap() {
        AsapMessage::DeregistrationResponse { error: Some(e), .. } => {
            assert_eq!(e.causes[0].code, CauseCode::REJECTED_SECURITY)
        }
        m => panic!("{m:?}"),
    }
    let mut cfg = pe_config(reg, "B", 7799, Policy::RoundRobin);
    cfg.id = Some(a.id());
    let thief = PoolElement::start(cfg).unwrap();
    let why = rejection(&thief).await;
    assert!(why.contains("Non-unique PE Identifier"), "{why}");
    let mut pu = pool_user(reg, None);
    let res = pu.resolve(&PoolHandle::from("B")).await.unwrap();
    assert_eq!(
        res.pool_elements[0].user_transport.to_string(),
        "tcp 127.0.0.1:7700"
    );
}

#[tokio::test]
async fn resolution_rate_limit_per_pool_user() {
    let r = registrar(Config {
        max_hr_rate: 5,
        ..fast_config()
    });
    let a = pe(r.asap_addr(), "R", 7800, Policy::RoundRobin);
    a.wait_registered(Duration::from_secs(5)).await.unwrap();
    let mut pu = pool_user(r.asap_addr(), None);
    let h = PoolHandle::from("R");
    let mut refused = 0;
    for _ in 0..20 {
        if let Err(rserpool_asap::Error::Refused(c)) = pu.resolve(&h).await {
            assert_eq!(c, CauseCode::REJECTED_SECURITY);
            refused += 1;
        }
    }
    assert!(refused >= 10, "burst of 20 at 5/s: {refused} refused");
    // Another pool user is not affected.
    assert_eq!(resolve_ids(r.asap_addr(), "R", 3).await, vec![a.id()]);
}

#[tokio::test]
async fn registrar_restart_makes_pes_reregister() {
    let r = registrar(fast_config());
    let addr = r.asap_addr();
    let pes: Vec<PoolElement> = (0..3)
        .map(|i| pe(addr, "RS", 7900 + i, Policy::RoundRobin))
        .collect();
    for p in &pes {
        p.wait_registered(Duration::from_secs(5)).await.unwrap();
    }
    let old_id = r.server_id();
    r.stop();
    let r2 = registrar(Config {
        asap: addr.into(),
        ..fast_config()
    });
    assert_ne!(r2.server_id(), old_id);
    let t = wait_for(Duration::from_secs(5), "all PEs re-registered", || async {
        resolve_ids(addr, "RS", 3).await.len() == 3
    })
    .await;
    eprintln!("3 PEs re-registered {t:?} after the registrar restart");
}

#[tokio::test]
async fn pes_find_the_registrar_by_server_announce() {
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let listen = udp.local_addr().unwrap();
    drop(udp);
    let r = registrar(Config {
        announce: vec![listen],
        announce_interval_ms: 100,
        ..fast_config()
    });
    let mut cfg = pe_config(r.asap_addr(), "A", 8000, Policy::RoundRobin);
    cfg.registrars.clear();
    cfg.announce_listen = Some(listen);
    let a = PoolElement::start(cfg).unwrap();
    let at = a.wait_registered(Duration::from_secs(5)).await.unwrap();
    assert_eq!(at, r.asap_addr());
}

#[tokio::test]
async fn status_shows_the_handlespace() {
    let r = registrar(fast_config());
    let a = pe(
        r.asap_addr(),
        "St",
        8100,
        Policy::LeastUsed {
            load: load_from_fraction(0.25),
        },
    );
    a.wait_registered(Duration::from_secs(5)).await.unwrap();
    let status = r.status_addr().unwrap().to_string();
    let out = run_bin(&["status", "--json", "--status", &status]).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let st: rserpool_registrar::Status = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(st.server_id, r.server_id());
    assert_eq!(st.pools.len(), 1);
    let p = &st.pools[0].pes[0];
    assert_eq!(p.id, a.id());
    assert_eq!(p.policy, "lu load=25.0%");
    assert_eq!(p.transport, "tcp 127.0.0.1:8100");
    assert_eq!(p.home_registrar, r.server_id());
}

#[tokio::test]
async fn status_has_a_listener_of_its_own_and_asap_does_not_speak_http() {
    let r = registrar(fast_config());
    let status = r.status_addr().unwrap();
    let a = pe(r.asap_addr(), "Own", 8150, Policy::RoundRobin);
    a.wait_registered(Duration::from_secs(5)).await.unwrap();
    let (code, body) = rserpool_status::get(status, "/status").await.unwrap();
    assert_eq!(code, 200);
    let st: rserpool_registrar::Status = serde_json::from_slice(&body).unwrap();
    assert_eq!(st.pool_elements, 1);
    assert_eq!(rserpool_status::get(status, "/nope").await.unwrap().0, 404);
    // A request with a body it does not read still gets its whole answer, not a reset.
    let mut s = tokio::net::TcpStream::connect(status).await.unwrap();
    s.write_all(b"POST /status HTTP/1.1\r\nContent-Length: 5000\r\n\r\n")
        .await
        .unwrap();
    s.write_all(&[b'x'; 5000]).await.unwrap();
    let mut reply = Vec::new();
    s.read_to_end(&mut reply).await.unwrap();
    let reply = String::from_utf8_lossy(&reply);
    assert!(reply.starts_with("HTTP/1.1 405"), "{reply}");
    assert!(reply.ends_with("only GET and HEAD\n"), "{reply}");
    // An HTTP request on the ASAP port is a malformed ASAP message now: the connection is
    // closed (after an ERROR), and the PE registered there is not disturbed.
    let mut s = tokio::net::TcpStream::connect(r.asap_addr()).await.unwrap();
    s.write_all(b"GET /status HTTP/1.0\r\n\r\n").await.unwrap();
    let mut reply = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut reply))
        .await
        .expect("the registrar closes the connection")
        .ok();
    assert!(
        !reply.starts_with(b"HTTP"),
        "{}",
        String::from_utf8_lossy(&reply)
    );
    // The old way of asking gets a pointer to the new one.
    let out = run_bin(&["status", "--registrar", &r.asap_addr().to_string()]).await;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--status ADDR"));
    assert_eq!(resolve_ids(r.asap_addr(), "Own", 5).await.len(), 1);
}

#[tokio::test]
async fn a_pool_user_that_does_not_read_is_disconnected() {
    let r = registrar(Config {
        max_pending_bytes: 64 * 1024,
        max_hr_rate: 0,
        ..fast_config()
    });
    let reg = r.asap_addr();
    let status = r.status_addr().unwrap();
    // 30 PEs: every answer carries all of them, about 2 KB.
    let pes: Vec<PoolElement> = (0..30)
        .map(|i| pe(reg, "Slow", 8200 + i, Policy::RoundRobin))
        .collect();
    for p in &pes {
        p.wait_registered(Duration::from_secs(5)).await.unwrap();
    }
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    let mut s = sock.connect(reg).await.unwrap();
    let req = AsapMessage::HandleResolution {
        subscribe: false,
        pool_handle: PoolHandle::from("Slow"),
        items: Some(30),
    }
    .to_bytes()
    .unwrap();
    // Ask and never read: the answers pile up until the registrar gives up on this peer.
    let flood = async {
        for _ in 0..20_000 {
            if s.write_all(&req).await.is_err() {
                return true;
            }
            tokio::task::yield_now().await;
        }
        false
    };
    let refused = tokio::time::timeout(Duration::from_secs(10), flood).await;
    assert!(
        matches!(refused, Ok(true)),
        "the registrar closed the connection"
    );
    // Everyone else is still served.
    assert_eq!(resolve_ids(reg, "Slow", 30).await.len(), 30);
    let out = run_bin(&["status", "--json", "--status", &status.to_string()]).await;
    let st: rserpool_registrar::Status = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(st.counters.slow_connections_closed, 1);
    assert_eq!(st.pools[0].pes.len(), 30);
}

/// `rserpool drain` for a PE run by `serve --control`: it leaves the pool (a resolution no
/// longer returns it), a health check that passes does not bring it back, its agent says
/// `drain`; `undrain` registers it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_drains_and_undrains_by_its_control_socket() {
    let r = registrar(fast_config());
    let target = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let target_addr = target.local_addr().unwrap();
    std::thread::spawn(move || for _ in target.incoming() {});
    let dir = std::env::temp_dir().join(format!("rserpool-serve-drain-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let control = dir.join("serve.sock");
    let agent = SocketAddr::from(([127, 0, 0, 1], common::free_port()));
    let _serve = spawn(&[
        "serve",
        "--target",
        &target_addr.to_string(),
        "--pool",
        "S",
        "--id",
        "7",
        "--check-interval-ms",
        "50",
        "--agent",
        &agent.to_string(),
        "--control",
        control.to_str().unwrap(),
        "--registrar",
        &r.asap_addr().to_string(),
    ]);
    let reg = r.asap_addr();
    wait_for(
        Duration::from_secs(10),
        "the PE registered",
        || async move { resolve_ids(reg, "S", 3).await == vec![7] },
    )
    .await;
    let agent_says = || async move {
        let mut s = TcpStream::connect(agent).await.unwrap();
        let mut line = String::new();
        s.read_to_string(&mut line).await.unwrap();
        line
    };
    assert_eq!(agent_says().await, "up ready 100%\n");
    let out = run_bin(&["drain", control.to_str().unwrap()]).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "drained");
    wait_for(Duration::from_secs(5), "the PE gone", || async move {
        resolve_ids(reg, "S", 3).await.is_empty()
    })
    .await;
    assert_eq!(agent_says().await, "drain\n");
    // Health checks go on passing: the PE stays out.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(resolve_ids(reg, "S", 3).await.is_empty());
    let out = run_bin(&["undrain", control.to_str().unwrap()]).await;
    assert!(out.status.success());
    wait_for(Duration::from_secs(5), "the PE back", || async move {
        resolve_ids(reg, "S", 3).await == vec![7]
    })
    .await;
    assert_eq!(agent_says().await, "up ready 100%\n");
    let _ = std::fs::remove_dir_all(dir);
}

/// An upgrade of the process running a PE: the association is handed over, not closed, so the
/// registrar sees the PE registered once, over one association, and never without it — five
/// times in a row, with keep-alives every 300 ms.
#[tokio::test]
async fn a_pe_handed_over_stays_registered_over_one_association() {
    let r = registrar(fast_config());
    let cfg = pe_config(r.asap_addr(), "H", 7600, Policy::LeastUsed { load: 0 });
    let mut current = PoolElement::start(cfg.clone()).unwrap();
    current
        .wait_registered(Duration::from_secs(5))
        .await
        .unwrap();
    let id = current.id();
    let reg = r.asap_addr();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let missing = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let (mut checked, mut missing) = (0, 0);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                checked += 1;
                if resolve_ids(reg, "H", 3).await != vec![id] {
                    missing += 1;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            (checked, missing)
        })
    };
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(400)).await;
        let association = current.hand_over().await.expect("registered: handed over");
        assert_eq!(association.0.id, id);
        // The old one goes without deregistering; the next starts a moment later.
        drop(current);
        tokio::time::sleep(Duration::from_millis(50)).await;
        current = PoolElement::from_hand_over(cfg.clone(), association).unwrap();
        assert_eq!(current.id(), id);
        current
            .wait_registered(Duration::from_secs(5))
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (checked, missing) = missing.await.unwrap();
    assert!(checked > 50, "{checked} resolutions");
    assert_eq!(
        missing, 0,
        "{missing} of {checked} resolutions without the PE"
    );
    let s = common::registrar_status(r.status_addr().unwrap())
        .await
        .unwrap()
        .counters;
    assert_eq!(s.registrations, 1, "registered anew");
    assert!(
        s.reregistrations >= 5,
        "{} re-registrations",
        s.reregistrations
    );
    assert!(
        s.keep_alive_acks >= 5,
        "{} keep-alive acks",
        s.keep_alive_acks
    );
    assert_eq!(
        s.removed_keep_alive_timeout + s.removed_connection_closed + s.removed_lifetime_expired,
        0
    );
    // The last one deregisters as usual.
    current.stop().await;
    wait_for(Duration::from_secs(2), "the deregistration", || async {
        resolve_ids(reg, "H", 3).await.is_empty()
    })
    .await;
}
