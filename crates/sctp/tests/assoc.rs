//! Two associations over a simulated network (delay, random loss, duplication and reordering,
//! a clock that jumps to the next event): the handshake, messages both ways delivered exactly
//! once and in stream order through loss, graceful shutdown, the ends that give up on a
//! silent peer, and two multi-homed ends that fail over when one network is cut.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use bytes::Bytes;
use rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use rserpool_sctp::assoc::Config;
use rserpool_sctp::path::{PathConfig, PathEvent};
use rserpool_sctp::{Association, Endpoint, Event, Outcome, Packet, State};
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

const DELAY: Duration = Duration::from_millis(5);

/// The two hosts have an address on each of two networks, 10.1/16 and 10.2/16; the client
/// knows the server's first.
fn client_addr(net: u8) -> SocketAddr {
    SocketAddr::from(([10, net, 0, 2], 9899))
}
fn server_addr(net: u8) -> SocketAddr {
    SocketAddr::from(([10, net, 0, 1], 9899))
}
fn net_of(a: SocketAddr) -> u8 {
    match a.ip() {
        IpAddr::V4(v4) => v4.octets()[1],
        IpAddr::V6(_) => 0,
    }
}

struct Sim {
    now: Instant,
    start: Instant,
    rng: Xoshiro256PlusPlus,
    /// Per cent of packets lost each way.
    loss: u64,
    /// Per cent of packets delivered twice, and held back 30 ms (so that later ones overtake).
    dup: u64,
    reorder: u64,
    /// In flight: when it arrives, whether to the server, from where (routing picks the
    /// sender's address on the network of the destination), the encoded packet.
    wire: Vec<(Instant, bool, SocketAddr, Bytes)>,
    /// Networks whose packets are dropped.
    cut: Vec<u8>,
    /// Packets that went to each network, client and server together.
    sent_on: [u64; 3],
    client: Association,
    endpoint: Endpoint,
    server: Option<Association>,
    client_events: Vec<Event>,
    server_events: Vec<Event>,
    /// The server stops receiving and sending (its host died).
    server_dead: bool,
}

impl Sim {
    fn new(loss: u64, seed: u64, cfg: Config) -> Self {
        Self::pair(loss, seed, cfg.clone(), cfg)
    }

    /// The client with one configuration, the server's endpoint with another.
    fn pair(loss: u64, seed: u64, cfg: Config, server_cfg: Config) -> Self {
        let now = Instant::now();
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let client = Association::connect(
            cfg.clone(),
            server_addr(1),
            5000,
            3863,
            rng.next_u32() | 1,
            rng.next_u32(),
            now,
        );
        let endpoint = Endpoint::new(server_cfg, 3863, [9; 32], seed ^ 0x5eed, now);
        Self {
            now,
            start: now,
            rng,
            loss,
            dup: 0,
            reorder: 0,
            wire: Vec::new(),
            cut: Vec::new(),
            sent_on: [0; 3],
            client,
            endpoint,
            server: None,
            client_events: Vec::new(),
            server_events: Vec::new(),
            server_dead: false,
        }
    }

    fn put(&mut self, to_server: bool, to: SocketAddr, p: &Packet) {
        let net = net_of(to);
        if let Some(n) = self.sent_on.get_mut(usize::from(net)) {
            *n += 1;
        }
        let from = if to_server {
            client_addr(net)
        } else {
            server_addr(net)
        };
        let lost = self.rng.next_u64() % 100 < self.loss || self.cut.contains(&net);
        if std::env::var_os("SCTP_SIM_TRACE").is_some() {
            let kinds: Vec<u8> = p.chunks.iter().map(|c| c.ty()).collect();
            eprintln!(
                "{:>8.3} {} {to} tag {:#010x} {kinds:?}{} (client {:?}, server {:?})",
                (self.now - self.start).as_secs_f64(),
                if to_server { "c→s" } else { "s→c" },
                p.tag,
                if lost { " LOST" } else { "" },
                self.client.state(),
                self.server
                    .as_ref()
                    .map(|s| (s.state(), s.poll_timeout().map(|t| t - self.start)))
            );
        }
        if lost {
            return;
        }
        let copies = if self.rng.next_u64() % 100 < self.dup {
            2
        } else {
            1
        };
        for _ in 0..copies {
            let mut jitter = Duration::from_micros(self.rng.next_u64() % 2000);
            if self.rng.next_u64() % 100 < self.reorder {
                jitter += Duration::from_millis(30);
            }
            self.wire
                .push((self.now + DELAY + jitter, to_server, from, p.encode()));
        }
    }

    /// Runs until `done` or `limit` of simulated time.
    fn run(&mut self, limit: Duration, mut done: impl FnMut(&Sim) -> bool) -> bool {
        let mut stuck = 0;
        while self.now - self.start < limit {
            while let Some((to, p)) = self.client.poll_transmit(self.now) {
                self.put(true, to, &p);
            }
            if !self.server_dead {
                while let Some((to, p)) =
                    self.server.as_mut().and_then(|s| s.poll_transmit(self.now))
                {
                    self.put(false, to, &p);
                }
            }
            while let Some(e) = self.client.poll_event() {
                self.client_events.push(e);
            }
            while let Some(e) = self.server.as_mut().and_then(|s| s.poll_event()) {
                self.server_events.push(e);
            }
            if done(self) {
                return true;
            }
            // The next moment something happens.
            let next = [
                self.wire.iter().map(|w| w.0).min(),
                self.client.poll_timeout(),
                self.server
                    .as_ref()
                    .filter(|_| !self.server_dead)
                    .and_then(|s| s.poll_timeout()),
            ]
            .into_iter()
            .flatten()
            .min();
            let Some(next) = next else { return done(self) };
            stuck = if next <= self.now { stuck + 1 } else { 0 };
            assert!(
                stuck < 10_000,
                "time stands still at {:?}: client {:?} (timeout {:?}), server {:?}",
                self.now - self.start,
                self.client.state(),
                self.client.poll_timeout().map(|t| t - self.start),
                self.server
                    .as_ref()
                    .map(|s| (s.state(), s.poll_timeout().map(|t| t - self.start)))
            );
            self.now = self.now.max(next);
            let due: Vec<(Instant, bool, SocketAddr, Bytes)> = {
                let now = self.now;
                let (due, later) = self.wire.drain(..).partition(|w| w.0 <= now);
                self.wire = later;
                due
            };
            for (_, to_server, from, bytes) in due {
                let p = Packet::decode(&bytes).unwrap();
                if !to_server {
                    self.client.handle(p, from, self.now);
                } else if self.server_dead {
                } else if let Some(s) = self.server.as_mut() {
                    // A driver finds the association by its addresses and ports: the one.
                    s.handle(p, from, self.now);
                } else {
                    match self.endpoint.handle(p, from, self.now) {
                        Outcome::Reply(r) => self.put(false, from, &r),
                        Outcome::Accept(a) => self.server = Some(*a),
                        Outcome::Ignore | Outcome::BadCookie(_) => {}
                    }
                }
            }
            self.client.handle_timeout(self.now);
            if !self.server_dead
                && let Some(s) = self.server.as_mut()
            {
                s.handle_timeout(self.now);
            }
        }
        done(self)
    }
}

fn messages(events: &[Event]) -> Vec<(u16, Bytes)> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Message(m) => Some((m.stream, m.data.clone())),
            _ => None,
        })
        .collect()
}

/// Message `i`: its own length (1 byte to 5 fragments) and contents.
fn message(i: usize) -> Bytes {
    let len = 1 + (i * 977) % 5500;
    Bytes::from((0..len).map(|k| (i + k) as u8).collect::<Vec<u8>>())
}

fn exchange(loss: u64, seed: u64) {
    exchange_on(Sim::new(loss, seed, Config::default()), seed);
}

fn exchange_on(mut sim: Sim, seed: u64) {
    let n = 200;
    for i in 0..n {
        sim.client
            .send((i % 3) as u16, 11, message(i), false)
            .unwrap();
    }
    assert!(
        // Simulated time: generous, as a path losing 15 % each way backs the RTO off far.
        sim.run(Duration::from_secs(7200), |s| s.server.is_some()
            && messages(&s.server_events).len() == n),
        "seed {seed}: {} of {n} messages arrived; client {}",
        messages(&sim.server_events).len(),
        sim.client.debug()
    );
    for i in 0..n {
        sim.server
            .as_mut()
            .unwrap()
            .send((i % 2) as u16, 12, message(i + 1000), false)
            .unwrap();
    }
    assert!(sim.run(
        Duration::from_secs(14_400),
        |s| messages(&s.client_events).len() == n
    ));
    // Per stream, in order and exactly once.
    let got = messages(&sim.server_events);
    for stream in 0..3u16 {
        let want: Vec<Bytes> = (0..n)
            .filter(|i| (i % 3) as u16 == stream)
            .map(message)
            .collect();
        let have: Vec<Bytes> = got
            .iter()
            .filter(|(s, _)| *s == stream)
            .map(|(_, d)| d.clone())
            .collect();
        assert_eq!(have, want, "seed {seed}, stream {stream}");
    }
    let back = messages(&sim.client_events);
    for stream in 0..2u16 {
        let want: Vec<Bytes> = (0..n)
            .filter(|i| (i % 2) as u16 == stream)
            .map(|i| message(i + 1000))
            .collect();
        let have: Vec<Bytes> = back
            .iter()
            .filter(|(s, _)| *s == stream)
            .map(|(_, d)| d.clone())
            .collect();
        assert_eq!(have, want, "seed {seed}, back on stream {stream}");
    }
    assert_eq!(sim.client_events.first(), Some(&Event::Connected));
    // A graceful end once everything is acknowledged.
    let now = sim.now;
    sim.client.shutdown(now);
    assert!(
        sim.run(Duration::from_secs(18_000), |s| s.client.state()
            == State::Closed
            && s.server
                .as_ref()
                .is_some_and(|a| a.state() == State::Closed)),
        "seed {seed}: client {:?}, server {:?}",
        sim.client.state(),
        sim.server.as_ref().map(|a| a.state())
    );
    assert!(
        sim.client_events.contains(&Event::Closed),
        "seed {seed}: {:?}",
        sim.client_events.last()
    );
    assert!(
        sim.server_events.contains(&Event::Closed),
        "seed {seed}: {:?}",
        sim.server_events.last()
    );
}

#[test]
fn messages_cross_a_clean_path_exactly_once_in_order() {
    exchange(0, 1);
}

#[test]
fn messages_cross_a_lossy_path_exactly_once_in_order() {
    // SCTP_SIM_SEED=S runs one seed (with SCTP_SIM_TRACE=1, every packet printed);
    // SCTP_SIM_SEEDS=N the first N.
    let var = |v: &str| std::env::var(v).ok().and_then(|s| s.parse::<u64>().ok());
    let seeds = match (var("SCTP_SIM_SEED"), var("SCTP_SIM_SEEDS")) {
        (Some(s), _) => s..=s,
        (None, Some(n)) => 1..=n,
        (None, None) => 1..=10,
    };
    for seed in seeds {
        exchange(15, seed);
    }
}

#[test]
fn messages_cross_a_path_that_duplicates_and_reorders_exactly_once_in_order() {
    for seed in 1..=10 {
        let mut sim = Sim::new(5, seed, Config::default());
        sim.dup = 10;
        sim.reorder = 10;
        exchange_on(sim, seed);
    }
}

#[test]
fn an_init_nobody_answers_ends_in_an_abort() {
    let cfg = Config {
        max_init_retransmits: 3,
        ..Config::default()
    };
    let mut sim = Sim::new(0, 3, cfg);
    sim.server_dead = true;
    assert!(sim.run(Duration::from_secs(120), |s| s.client.state()
        == State::Closed));
    assert!(matches!(sim.client_events.last(), Some(Event::Aborted(_))));
    // 1 + 2 + 4 s of backoff, then the fourth timeout.
    assert!(sim.now - sim.start >= Duration::from_secs(7));
}

#[test]
fn a_peer_that_dies_is_given_up_after_its_retransmissions() {
    let cfg = Config {
        max_retransmits: 4,
        paths: PathConfig {
            heartbeat_interval: Duration::from_secs(1),
            ..PathConfig::default()
        },
        ..Config::default()
    };
    let mut sim = Sim::new(0, 4, cfg);
    assert!(sim.run(Duration::from_secs(10), |s| {
        s.client_events.contains(&Event::Connected)
    }));
    sim.server_dead = true;
    sim.client
        .send(0, 11, Bytes::from_static(b"into the void"), false)
        .unwrap();
    let died = sim.now;
    assert!(sim.run(Duration::from_secs(600), |s| s.client.state()
        == State::Closed));
    assert!(
        matches!(sim.client_events.last(), Some(Event::Aborted(_))),
        "{:?}",
        sim.client_events
    );
    assert!(
        sim.now - died < Duration::from_secs(120),
        "{:?}",
        sim.now - died
    );
}

#[test]
fn an_idle_association_stays_up_on_heartbeats() {
    let cfg = Config {
        paths: PathConfig {
            heartbeat_interval: Duration::from_secs(2),
            ..PathConfig::default()
        },
        ..Config::default()
    };
    let mut sim = Sim::new(10, 5, cfg);
    assert!(sim.run(Duration::from_secs(30), |s| {
        s.client_events.contains(&Event::Connected)
    }));
    let t = sim.now;
    sim.run(Duration::from_secs(300), |s| {
        s.now - t > Duration::from_secs(200)
    });
    assert_eq!(sim.client.state(), State::Established);
    assert_eq!(
        sim.server.as_ref().map(|a| a.state()),
        Some(State::Established)
    );
}

/// Both ends list both their addresses (multi-homing): network 1, which the association
/// started on, is cut while messages flow both ways; every message still arrives exactly
/// once and in order, over network 2, within seconds; the association stays up. Network 1
/// comes back: its paths come up again and data returns to the primary.
#[test]
fn a_multi_homed_association_fails_over_when_a_network_is_cut_and_comes_back() {
    let ends = |addr: fn(u8) -> SocketAddr| Config {
        local_addresses: vec![addr(1).ip(), addr(2).ip()],
        paths: PathConfig {
            heartbeat_interval: Duration::from_secs(2),
            ..PathConfig::default()
        },
        ..Config::default()
    };
    for seed in 1..=5 {
        let mut sim = Sim::pair(0, seed, ends(client_addr), ends(server_addr));
        let both_up = |s: &Sim| {
            s.client_events
                .contains(&Event::Path(PathEvent::Up(server_addr(2))))
                && s.server_events
                    .contains(&Event::Path(PathEvent::Up(client_addr(2))))
        };
        assert!(
            sim.run(Duration::from_secs(30), both_up),
            "seed {seed}: second paths confirmed: client {:?}, server {:?}",
            sim.client_events,
            sim.server_events
        );
        assert_eq!(sim.client.current_path(), server_addr(1));
        let sent = |sim: &mut Sim, from: usize, n: usize| {
            for i in from..from + n {
                sim.client.send(0, 11, message(i), false).unwrap();
                let s = sim.server.as_mut().unwrap();
                s.send(1, 12, message(i + 5000), false).unwrap();
            }
        };
        let arrived = |n: usize| {
            move |s: &Sim| {
                messages(&s.server_events).len() == n && messages(&s.client_events).len() == n
            }
        };
        sent(&mut sim, 0, 50);
        assert!(sim.run(Duration::from_secs(60), arrived(50)), "seed {seed}");
        let before = sim.sent_on;
        sim.cut = vec![1];
        let cut_at = sim.now;
        sent(&mut sim, 50, 150);
        assert!(
            sim.run(Duration::from_secs(600), arrived(200)),
            "seed {seed}: {} and {} of 200 arrived after the cut; client {}",
            messages(&sim.server_events).len(),
            messages(&sim.client_events).len(),
            sim.client.debug()
        );
        let took = sim.now - cut_at;
        assert!(took < Duration::from_secs(10), "seed {seed}: {took:?}");
        assert_eq!(sim.client.state(), State::Established);
        assert_eq!(sim.client.current_path(), server_addr(2), "seed {seed}");
        assert!(
            sim.sent_on[2] - before[2] > 100,
            "seed {seed}: {:?}",
            sim.sent_on
        );
        // In order, exactly once.
        let want: Vec<(u16, Bytes)> = (0..200).map(|i| (0, message(i))).collect();
        assert_eq!(messages(&sim.server_events), want, "seed {seed}");
        let back: Vec<(u16, Bytes)> = (0..200).map(|i| (1, message(i + 5000))).collect();
        assert_eq!(messages(&sim.client_events), back, "seed {seed}");
        // Network 1 back: its paths answer heartbeats again and carry the data.
        sim.cut.clear();
        let healed = sim.now;
        assert!(
            sim.run(Duration::from_secs(120), |s| s.client.current_path()
                == server_addr(1)),
            "seed {seed}: the primary never came back"
        );
        assert!(sim.now - healed < Duration::from_secs(70), "seed {seed}");
        let on_1 = sim.sent_on[1];
        sent(&mut sim, 200, 20);
        assert!(
            sim.run(Duration::from_secs(60), arrived(220)),
            "seed {seed}"
        );
        assert!(
            sim.sent_on[1] - on_1 >= 20,
            "seed {seed}: {:?}",
            sim.sent_on
        );
    }
}
