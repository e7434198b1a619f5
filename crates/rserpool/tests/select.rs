//! The proxy-local selections over real sockets: a real registrar, real PEs and a real proxy
//! whose pool is configured with `select = least-connections | p2c | prequal`. Each test also
//! runs the pool's own policy (round robin) as the control, so that it fails if the
//! configured selection does nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{
    KillOnDrop, answer_after, answers, example_http, fast_config, free_port, id, registrar,
    wait_until,
};
use rserpool_asap::{PoolElement, PoolElementConfig};
use rserpool_proxy::http::client::Client;
use rserpool_proxy::{ListenerConfig, Mode, PoolConfig, Proxy, ProxyConfig, Select};
use rserpool_wire::Policy;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::net::TcpListener;

const POOL: &str = "Select";

async fn proxy(reg: SocketAddr, select: Select) -> Proxy {
    let p = Proxy::start(ProxyConfig {
        registrars: vec![reg.into()],
        listeners: vec![ListenerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], free_port())),
            mode: Mode::Http,
            pool: Some(POOL.into()),
            routes: Vec::new(),
            splice: None,
            certificates: Vec::new(),
            http2: true,
            defer_accept: None,
        }],
        pool_settings: BTreeMap::from([(
            POOL.to_string(),
            PoolConfig {
                select,
                ..PoolConfig::default()
            },
        )]),
        ..ProxyConfig::default()
    })
    .await
    .unwrap();
    assert_eq!(p.pools().all()[0].config().select, select);
    p
}

/// `rserpool example http` as PE `pe` with policy round robin.
async fn example(reg: SocketAddr, pe: u32) -> KillOnDrop {
    example_http(reg, POOL, pe, &["--policy", "rr"]).await
}

async fn wait_for_pes(p: &Proxy, n: usize) {
    wait_until(Duration::from_secs(10), "the proxy knows the PEs", || {
        p.pools().all().iter().map(|pool| pool.len()).sum::<usize>() == n
    })
    .await;
}

/// While one long request holds a PE, every short request goes to the other PE; under the
/// pool's own round robin they alternate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_connections_and_p2c_send_nothing_to_a_pe_with_work_in_flight() {
    let reg = registrar(fast_config());
    let r = reg.asap_addr();
    let _pes = [example(r, 1).await, example(r, 2).await];
    for select in [Select::LeastConnections, Select::P2c, Select::Policy] {
        let p = proxy(r, select).await;
        let front = p.local_addrs()[0];
        wait_for_pes(&p, 2).await;
        let long = tokio::spawn(async move {
            let mut c = Client::connect(front).await.unwrap();
            c.get("/work?us=1500000").await.unwrap().header("x-pe-id")
        });
        wait_until(
            Duration::from_secs(5),
            "the long request is in flight",
            || {
                p.pools().all()[0]
                    .backends()
                    .iter()
                    .any(|b| b.in_flight() == 1)
            },
        )
        .await;
        let short = answers(front, 10).await;
        let held = long.await.unwrap().unwrap();
        let to_held = short.iter().filter(|a| **a == held).count();
        if select == Select::Policy {
            assert!(
                to_held >= 4,
                "round robin ignores work in flight: {short:?}"
            );
        } else {
            assert_eq!(
                to_held, 0,
                "{select:?} sent to {held} while busy: {short:?}"
            );
        }
    }
}

/// Three PEs, one of which answers in 80 ms and the others at once: the Prequal-style
/// selection learns the latencies and sends the slow PE hardly anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prequal_sends_little_to_a_slow_pe() {
    let reg = registrar(fast_config());
    let r = reg.asap_addr();
    let mut elements = Vec::new();
    for (pe, delay) in [(1u32, 0u64), (2, 0), (3, 80)] {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut cfg =
            PoolElementConfig::new(POOL, listener.local_addr().unwrap(), Policy::RoundRobin);
        cfg.registrars = vec![r];
        cfg.id = Some(pe);
        elements.push(PoolElement::start(cfg).unwrap());
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                tokio::spawn(answer_after(s, pe, Duration::from_millis(delay), None));
            }
        });
    }
    for select in [Select::Prequal, Select::Policy] {
        let p = proxy(r, select).await;
        wait_for_pes(&p, 3).await;
        let got = answers(p.local_addrs()[0], 45).await;
        let slow = got.iter().filter(|a| **a == id(3)).count();
        if select == Select::Policy {
            assert!(slow >= 10, "round robin: {slow} of 45 to the slow PE");
        } else {
            assert!(slow <= 4, "prequal: {slow} of 45 to the slow PE: {got:?}");
        }
    }
}

/// `rserpool proxy --select` as a user types it: the selection lands in the pool's settings
/// (as `--print-config` shows them), and a name the proxy does not know is refused.
#[test]
fn the_select_flag_sets_the_pools_selection() {
    let run = |extra: &[&str]| {
        std::process::Command::new(common::BIN)
            .args(["proxy", "--listen", "127.0.0.1:1", "--pool", "Web"])
            .args(extra)
            .output()
            .unwrap()
    };
    let out = run(&["--select", "p2c", "--print-config"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let cfg = ProxyConfig::from_toml(&text).unwrap();
    assert_eq!(cfg.pool_config("Web").select, Select::P2c);
    let out = run(&["--select", "fastest"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("least-connections"));
}
