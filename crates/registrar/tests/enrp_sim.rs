//! Several registrar cores under a simulated network and clock: ENRP without sockets.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use rserpool_registrar::{Config, ConnId, Registrar};
use rserpool_wire::{
    AsapMessage, Policy, PoolElement, PoolHandle, TransportAddress, UserTransport,
};
use std::collections::HashMap;
use std::net::SocketAddr;

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// Registrars joined by reliable in-order links (TCP), delivering everything each step.
struct Net {
    regs: Vec<Registrar>,
    enrp: Vec<SocketAddr>,
    links: HashMap<(usize, ConnId), (usize, ConnId)>,
    now: u64,
}

impl Net {
    fn new(n: usize) -> Self {
        let enrp: Vec<SocketAddr> = (0..n).map(|i| addr(9901 + i as u16)).collect();
        let regs = (0..n)
            .map(|i| {
                let cfg = Config {
                    peer: enrp.clone(),
                    ..Config::default()
                };
                let mut r = Registrar::new(cfg, 0x1000_0000 + i as u32, 0);
                r.enable_enrp(enrp[i], 0);
                r
            })
            .collect();
        Self {
            regs,
            enrp,
            links: HashMap::new(),
            now: 0,
        }
    }

    fn step(&mut self, ms: u64) {
        self.now += ms;
        let now = self.now;
        for i in 0..self.regs.len() {
            while let Some((c, to)) = self.regs[i].poll_connect() {
                let j = self.enrp.iter().position(|a| *a == to).unwrap();
                let cj = self.regs[j].accept_enrp(self.enrp[i], now).unwrap();
                self.links.insert((i, c), (j, cj));
                self.links.insert((j, cj), (i, c));
            }
            if self.regs[i].poll_timeout().is_some_and(|t| t <= now) {
                self.regs[i].handle_timeout(now);
            }
        }
        for _ in 0..10 {
            let mut moved = false;
            let links: Vec<_> = self.links.iter().map(|(a, b)| (*a, *b)).collect();
            for ((i, c), (j, cj)) in links {
                let data = self.regs[i].output(c).to_vec();
                if data.is_empty() {
                    continue;
                }
                self.regs[i].consume_output(c, data.len());
                self.regs[j].handle_data(cj, &data, now);
                moved = true;
            }
            let mut dirty = Vec::new();
            for r in &mut self.regs {
                r.take_dirty(&mut dirty);
            }
            if !moved {
                break;
            }
        }
    }
}

fn register(r: &mut Registrar, conn: ConnId, id: u32, now: u64) {
    let msg = AsapMessage::Registration {
        pool_handle: PoolHandle::from("P"),
        pool_element: PoolElement {
            id,
            home_registrar: 0,
            registration_life: 60,
            user_transport: UserTransport::Address(TransportAddress::tcp(addr(20_000))),
            policy: Policy::RoundRobin,
            asap_transport: None,
        },
    };
    r.handle_data(conn, &msg.to_bytes().unwrap(), now);
    let n = r.output(conn).len();
    r.consume_output(conn, n);
}

#[test]
fn three_registrars_share_every_pe_and_agree_on_checksums() {
    let mut net = Net::new(3);
    net.step(100);
    let mut pe_conns = Vec::new();
    for i in 0..3 {
        let c = net.regs[i]
            .accept(addr(30_000 + i as u16), net.now)
            .unwrap();
        for k in 0..30 {
            register(&mut net.regs[i], c, (i as u32 + 1) * 1000 + k, net.now);
        }
        pe_conns.push(c);
    }
    for _ in 0..30 {
        net.step(100);
    }
    let ids: Vec<u32> = net.regs.iter().map(Registrar::id).collect();
    for r in &net.regs {
        assert_eq!(r.handlespace().len(), 90, "registrar {:#x}", r.id());
        for &owner in &ids {
            assert_eq!(
                r.handlespace().checksum(owner),
                net.regs[0].handlespace().checksum(owner),
                "checksum of {owner:#x} at {:#x}",
                r.id()
            );
            assert_eq!(r.handlespace().owned_count(owner), 30);
        }
    }
    // A PE's connection closes at its home: every registrar drops its 30 PEs.
    net.regs[1].handle_close(pe_conns[1], net.now);
    net.step(100);
    for r in &net.regs {
        assert_eq!(r.handlespace().len(), 60, "registrar {:#x}", r.id());
        assert_eq!(r.handlespace().owned_count(ids[1]), 0);
    }
}
