//! Two stacks over a simulated datagram network with loss: many associations behind one
//! socket each, found by address and ports; a listening stack echoes every message on the
//! association it came on; all of them shut down and are forgotten; an INIT to a port
//! nobody listens on is aborted.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use bytes::Bytes;
use rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use rserpool_sctp::assoc::Config;
use rserpool_sctp::{AssocId, Stack, StackEvent};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

struct Net {
    now: Instant,
    rng: Xoshiro256PlusPlus,
    loss: u64,
    wire: Vec<(Instant, usize, SocketAddr, Bytes)>,
    stacks: [Stack; 2],
    addrs: [SocketAddr; 2],
    events: [Vec<StackEvent>; 2],
}

impl Net {
    fn step(&mut self) {
        for i in 0..2 {
            while let Some((to, d)) = self.stacks[i].poll_transmit(self.now) {
                let j = self.addrs.iter().position(|a| *a == to).unwrap();
                if self.rng.next_u64() % 100 >= self.loss {
                    let at = self.now + Duration::from_millis(2 + self.rng.next_u64() % 3);
                    self.wire.push((at, j, self.addrs[i], d));
                }
            }
            while let Some(e) = self.stacks[i].poll_event() {
                self.events[i].push(e);
            }
        }
        let next = [
            self.wire.iter().map(|w| w.0).min(),
            self.stacks[0].poll_timeout(),
            self.stacks[1].poll_timeout(),
        ]
        .into_iter()
        .flatten()
        .min();
        let Some(next) = next else { return };
        self.now = self.now.max(next);
        let now = self.now;
        let (due, later): (Vec<_>, Vec<_>) = self.wire.drain(..).partition(|w| w.0 <= now);
        self.wire = later;
        for (_, to, from, d) in due {
            self.stacks[to].handle_datagram(from, &d, now);
        }
        for s in &mut self.stacks {
            s.handle_timeout(now);
        }
    }
}

#[test]
fn many_associations_behind_one_socket_echo_and_close() {
    let now = Instant::now();
    let cfg = Config::default();
    let mut server = Stack::new(cfg.clone(), [1; 32], 11, now);
    server.listen(3863);
    let client = Stack::new(cfg, [2; 32], 22, now);
    let mut net = Net {
        now,
        rng: Xoshiro256PlusPlus::seed_from_u64(7),
        loss: 10,
        wire: Vec::new(),
        stacks: [server, client],
        addrs: [
            "192.0.2.1:9899".parse().unwrap(),
            "192.0.2.2:9899".parse().unwrap(),
        ],
        events: [Vec::new(), Vec::new()],
    };
    let server_addr = net.addrs[0];
    let ids: Vec<AssocId> = (0..20)
        .map(|k| net.stacks[1].connect(server_addr, 40_000 + k, 3863, now))
        .collect();
    let refused = net.stacks[1].connect(server_addr, 41_000, 4444, now);
    for (k, id) in ids.iter().enumerate() {
        for m in 0..5 {
            let text = format!("association {k} message {m}");
            net.stacks[1].send(*id, 0, 11, Bytes::from(text)).unwrap();
        }
    }
    // Run, echoing on the server side, until every echo is back.
    let mut echoed: HashMap<AssocId, Vec<Bytes>> = HashMap::new();
    let t0 = net.now;
    while net.now - t0 < Duration::from_secs(300) {
        net.step();
        for e in net.events[0].drain(..) {
            if let StackEvent::Message(id, m) = e {
                net.stacks[0].send(id, m.stream, m.ppid, m.data).unwrap();
            }
        }
        for e in net.events[1].drain(..) {
            match e {
                StackEvent::Message(id, m) => echoed.entry(id).or_default().push(m.data),
                StackEvent::Closed(id, why) => {
                    assert_eq!(id, refused, "{why:?}");
                    assert!(why.is_some(), "an abort");
                }
                _ => {}
            }
        }
        if echoed.values().map(Vec::len).sum::<usize>() == 100 {
            break;
        }
    }
    for (k, id) in ids.iter().enumerate() {
        let want: Vec<Bytes> = (0..5)
            .map(|m| Bytes::from(format!("association {k} message {m}")))
            .collect();
        assert_eq!(echoed.get(id), Some(&want), "association {k}");
    }
    assert_eq!(
        net.stacks[1].state(refused),
        None,
        "the refused one is gone"
    );
    assert_eq!(net.stacks[0].len(), 20);
    // Every one shut down from the client side: both stacks forget them.
    for id in &ids {
        let now = net.now;
        net.stacks[1].shutdown(*id, now);
    }
    let mut closed: BTreeMap<usize, usize> = BTreeMap::new();
    let t0 = net.now;
    while net.now - t0 < Duration::from_secs(300)
        && !(net.stacks[0].is_empty() && net.stacks[1].is_empty())
    {
        net.step();
        for i in 0..2 {
            for e in net.events[i].drain(..) {
                if let StackEvent::Closed(_, why) = e {
                    assert_eq!(why, None, "gracefully");
                    *closed.entry(i).or_default() += 1;
                }
            }
        }
    }
    assert!(net.stacks[0].is_empty() && net.stacks[1].is_empty());
    assert_eq!(closed.get(&1), Some(&20));
}

/// Both ends open the association between the same two ports at once (two registrars that
/// are each other's configured ENRP peer): an INIT collision (RFC 9260 §5.2). Each side ends
/// with one established association, and messages go both ways on it; with loss too.
#[test]
fn an_init_collision_ends_in_one_association_each_side() {
    for seed in 0..50 {
        let now = Instant::now();
        let cfg = Config::default();
        let mut a = Stack::new(cfg.clone(), [1; 32], 100 + seed, now);
        let mut b = Stack::new(cfg, [2; 32], 200 + seed, now);
        a.listen(9901);
        b.listen(9901);
        let addrs: [SocketAddr; 2] = [
            "192.0.2.1:9899".parse().unwrap(),
            "192.0.2.2:9899".parse().unwrap(),
        ];
        let ia = a.connect(addrs[1], 9901, 9901, now);
        let ib = b.connect(addrs[0], 9901, 9901, now);
        let mut net = Net {
            now,
            rng: Xoshiro256PlusPlus::seed_from_u64(seed),
            loss: if seed % 2 == 0 { 0 } else { 15 },
            wire: Vec::new(),
            stacks: [a, b],
            addrs,
            events: [Vec::new(), Vec::new()],
        };
        net.stacks[0]
            .send(ia, 0, 12, Bytes::from_static(b"from a"))
            .unwrap();
        net.stacks[1]
            .send(ib, 0, 12, Bytes::from_static(b"from b"))
            .unwrap();
        let t0 = net.now;
        let got = |events: &[StackEvent], text: &[u8]| {
            events
                .iter()
                .any(|e| matches!(e, StackEvent::Message(_, m) if m.data.as_ref() == text))
        };
        while net.now - t0 < Duration::from_secs(120)
            && !(got(&net.events[0], b"from b") && got(&net.events[1], b"from a"))
        {
            net.step();
        }
        for (i, (id, from)) in [(ia, "from b"), (ib, "from a")].into_iter().enumerate() {
            let ev = &net.events[i];
            assert!(
                got(ev, from.as_bytes()),
                "seed {seed}: side {i} got no message: {ev:?}"
            );
            assert!(
                ev.iter().any(|e| *e == StackEvent::Connected(id)),
                "seed {seed}: side {i} not connected: {ev:?}"
            );
            assert!(
                !ev.iter()
                    .any(|e| matches!(e, StackEvent::Closed(..) | StackEvent::Accepted { .. })),
                "seed {seed}: side {i}: {ev:?}"
            );
            assert_eq!(
                net.stacks[i].len(),
                1,
                "seed {seed}: one association on side {i}"
            );
            assert_eq!(
                net.stacks[i].state(id),
                Some(rserpool_sctp::State::Established)
            );
        }
    }
}
