//! A PE whose path to its registrar loses packets stays in its pool.
//!
//! Over TCP a lost keep-alive is retransmitted, first after 200 ms and then with a doubling
//! timer, so a keep-alive timeout of a second is often shorter than its delivery. The chaos
//! soak (docs/RELIABILITY.md) found PEs of a registrar whose link lost 30–40 % of its packets
//! missing from their pool for about 15 s, every hour. A registrar now asks its kernel
//! (`TCP_INFO`) whether a timed-out keep-alive is still on its way, and waits for it up to
//! three timeouts after it was sent.
//!
//! Here one PE's packets from the registrar are dropped (nftables) for 1.3 s at a time while
//! twenty others keep the network talkative, so the registrar cannot take a silence of the
//! network for the reason; it must keep the PE through every cut. Needs root and nft.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{fast_config, registrar, registrar_status, wait_for};
use rserpool_asap::{PoolElement, PoolElementConfig};
use rserpool_registrar::Config;
use rserpool_wire::Policy;
use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

fn pe(reg: SocketAddr, port: u16) -> PoolElement {
    let mut cfg = PoolElementConfig::new(
        "lossy",
        SocketAddr::from(([127, 0, 0, 1], port)),
        Policy::RoundRobin,
    );
    cfg.registrars = vec![reg];
    PoolElement::start(cfg).unwrap()
}

/// The loopback ports of the registrar's established ASAP connections' other ends.
fn peer_ports(reg: SocketAddr) -> Vec<u16> {
    let out = Command::new("ss")
        .args(["-tnH", "state", "established"])
        .arg(format!("( sport = :{} )", reg.port()))
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            l.split_whitespace()
                .last()?
                .rsplit_once(':')?
                .1
                .parse()
                .ok()
        })
        .collect()
}

/// An nftables table of its own that drops what the registrar sends to one port.
struct Cut {
    table: String,
}

impl Cut {
    fn new() -> Self {
        let table = format!("rsp_lossy_{}", std::process::id());
        nft(&format!(
            "add table inet {table}\nadd chain inet {table} out {{ type filter hook output priority 0; }}\n"
        ));
        Self { table }
    }

    fn drop_to(&self, reg: SocketAddr, port: u16) {
        let t = &self.table;
        nft(&format!(
            "add rule inet {t} out tcp sport {} tcp dport {port} drop\n",
            reg.port()
        ));
    }

    fn heal(&self) {
        nft(&format!("flush chain inet {} out\n", self.table));
    }
}

impl Drop for Cut {
    fn drop(&mut self) {
        nft(&format!("delete table inet {}\n", self.table));
    }
}

fn nft(script: &str) {
    use std::io::Write;
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("nft runs");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(script.as_bytes())
        .unwrap();
    assert!(child.wait().unwrap().success(), "nft -f: {script}");
}

const TALKATIVE: u16 = 20;
const ALL: usize = TALKATIVE as usize + 1;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pe_over_a_lossy_path_stays_registered() {
    let root = rustix::process::geteuid().is_root();
    if !root && rserpool_ksplice::testbed::skip("nftables needs root") {
        return;
    }
    let reg = registrar(Config {
        keep_alive_interval_ms: 1000,
        keep_alive_timeout_ms: 1000,
        ..fast_config()
    });
    let asap = reg.asap_addr();
    let status = reg.status_addr().unwrap();
    let lossy = pe(asap, 7001);
    wait_for(Duration::from_secs(5), "the PE's registration", || async {
        peer_ports(asap).len() == 1
    })
    .await;
    let port = peer_ports(asap)[0];
    // Registered 50 ms apart, their keep-alives answered 50 ms apart: the network is never
    // silent for a quarter of the keep-alive timeout, which would hold every timeout anyway.
    let mut talkative = Vec::new();
    for i in 0..TALKATIVE {
        talkative.push(pe(asap, 7100 + i));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    wait_for(Duration::from_secs(5), "every PE", || async {
        registrar_status(status)
            .await
            .is_some_and(|s| s.pool_elements == ALL)
    })
    .await;
    let cut = Cut::new();
    for _ in 0..8 {
        cut.drop_to(asap, port);
        tokio::time::sleep(Duration::from_millis(1300)).await;
        cut.heal();
        tokio::time::sleep(Duration::from_millis(2200)).await;
        let s = registrar_status(status).await.unwrap();
        assert_eq!(
            s.counters.removed_keep_alive_timeout, 0,
            "a PE left for an unanswered keep-alive: {:?}",
            s.counters
        );
        assert_eq!(s.pool_elements, ALL);
    }
    let s = registrar_status(status).await.unwrap();
    assert!(
        s.counters.keep_alive_timeouts_held_on_lossy_path > 0,
        "the cuts delayed no keep-alive past its timeout: {:?}",
        s.counters
    );
    assert_eq!(peer_ports(asap).len(), ALL, "no PE registered again");
    assert!(peer_ports(asap).contains(&port));
    drop(talkative);
    drop(lossy);
}
