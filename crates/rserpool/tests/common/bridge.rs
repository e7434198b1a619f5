//! Network namespaces on one bridge, for tests that need hosts of their own (rsplib's and
//! usrsctp's SCTP stacks read every packet of their namespace).

use std::process::{Command, Stdio};

pub fn sh(args: &[&str]) {
    let ok = Command::new(args[0])
        .args(&args[1..])
        .status()
        .unwrap()
        .success();
    assert!(ok, "{args:?}");
}

/// Network namespaces on one bridge: the first holds the bridge and 192.0.2.1, the others
/// 192.0.2.2, 192.0.2.3, … on veths to it.
pub struct Net {
    pub names: Vec<String>,
}

impl Net {
    pub fn new(hosts: usize) -> Self {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tag = format!("{}n{n}", std::process::id() % 100_000);
        let names: Vec<String> = (0..hosts).map(|i| format!("rsp{tag}h{i}")).collect();
        for n in &names {
            let _ = Command::new("ip")
                .args(["netns", "del", n])
                .stderr(Stdio::null())
                .status();
            sh(&["ip", "netns", "add", n]);
            sh(&["ip", "-n", n, "link", "set", "lo", "up"]);
        }
        let net = Net { names };
        net.network(("br0", "v", "eth0"), Self::addr);
        net
    }

    /// A bridge in the first namespace with address 0 of `addr`, and in each other one an
    /// interface on it with address i: `names` are the bridge's, the prefix of its ports and
    /// the hosts' interface.
    fn network(&self, names: (&str, &str, &str), addr: fn(usize) -> String) {
        let (bridge, prefix, iface) = names;
        let hub = &self.names[0];
        let hub_addr = format!("{}/24", addr(0));
        sh(&["ip", "-n", hub, "link", "add", bridge, "type", "bridge"]);
        sh(&["ip", "-n", hub, "addr", "add", &hub_addr, "dev", bridge]);
        sh(&["ip", "-n", hub, "link", "set", bridge, "up"]);
        for (i, n) in self.names.iter().enumerate().skip(1) {
            let port = format!("{prefix}{i}");
            sh(&[
                "ip", "-n", hub, "link", "add", &port, "type", "veth", "peer", "name", iface,
                "netns", n,
            ]);
            sh(&[
                "ip", "-n", hub, "link", "set", &port, "master", bridge, "up",
            ]);
            let a = format!("{}/24", addr(i));
            sh(&["ip", "-n", n, "addr", "add", &a, "dev", iface]);
            sh(&["ip", "-n", n, "link", "set", iface, "up"]);
        }
    }

    pub fn addr(i: usize) -> String {
        format!("192.0.2.{}", i + 1)
    }

    /// A second network beside the first (multi-homing): a bridge `br1` in the first
    /// namespace with 198.51.100.1, and 198.51.100.2, 198.51.100.3, … on `eth1` of the others.
    pub fn second_network(&self) {
        self.network(("br1", "w", "eth1"), Self::second_addr);
    }

    pub fn second_addr(i: usize) -> String {
        format!("198.51.100.{}", i + 1)
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}
