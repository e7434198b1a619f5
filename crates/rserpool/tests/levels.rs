//! Service levels over real sockets: a real registrar, `rserpool example http` PEs that
//! serve by level, and a proxy whose pool is limited (`max-conn`) so that requests queue at
//! it and are admitted by level.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{example_http, free_port, local_config, registrar, wait_until};
use rserpool_proxy::http::client::Client;
use rserpool_proxy::{Proxy, ProxyConfig};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

const POOL: &str = "Levels";

/// A proxy in front of `POOL`: one request in flight per PE, and a request with
/// `X-Client: gold` at level 9, every other at level 1.
async fn proxy(reg: SocketAddr, queue: usize) -> Proxy {
    let listen = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let text = format!(
        r#"
registrars = ["{reg}"]
refresh-ms = 100
[[listener]]
listen = "{listen}"
mode = "http"
pool = "{POOL}"
[pool.{POOL}]
max-conn = 1
queue = {queue}
queue-timeout-ms = 30000
[levels]
retry-after-s = 2
[[levels.rule]]
header = "x-client"
value = "gold"
level = 9
"#
    );
    let cfg = ProxyConfig::from_toml(&text).unwrap();
    Proxy::start(cfg).await.unwrap()
}

async fn wait_for_pes(p: &Proxy, n: usize) {
    wait_until(Duration::from_secs(10), "the proxy knows the PEs", || {
        p.pools().all().iter().map(|pool| pool.len()).sum::<usize>() == n
    })
    .await;
}

fn get(path: &str, client: Option<&str>, extra: &str) -> Vec<u8> {
    let who = client.map_or(String::new(), |c| format!("X-Client: {c}\r\n"));
    format!("GET {path} HTTP/1.1\r\nHost: test\r\n{who}{extra}\r\n").into_bytes()
}

/// One request on a new connection: status, its `X-Level` (the level the PE served it
/// at), its `Retry-After`, and how long it took.
async fn one(front: SocketAddr, req: Vec<u8>) -> (u16, Option<String>, Option<String>, Duration) {
    let t = Instant::now();
    let mut c = Client::connect(front).await.unwrap();
    let r = c.send(&req).await.unwrap();
    (
        r.code,
        r.header("x-level"),
        r.header("retry-after"),
        t.elapsed(),
    )
}

fn level_stats(p: &Proxy, level: usize) -> Option<rserpool_proxy::LevelStats> {
    p.pools().all()[0]
        .level_stats()
        .into_iter()
        .find(|l| l.level == level)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_cannot_choose_its_level() {
    let reg = registrar(local_config());
    let r = reg.asap_addr();
    let _pe = example_http(r, POOL, 1, &["--policy", "rr", "--levels", "9"]).await;
    let p = proxy(r, 64).await;
    let front = p.local_addrs()[0];
    wait_for_pes(&p, 1).await;
    // The proxy's own header, sent by a client, is dropped: the PE sees level 1.
    let spoofed = one(front, get("/", None, "X-Rserpool-Level: 9\r\n")).await;
    assert_eq!((spoofed.0, spoofed.1.as_deref()), (200, Some("1")));
    let twice = one(
        front,
        get("/", None, "x-rserpool-level: 9\r\nX-RSERPOOL-LEVEL: 8\r\n"),
    )
    .await;
    assert_eq!(twice.1.as_deref(), Some("1"));
    // A rule's header with the wrong value is not the rule's either.
    let wrong = one(front, get("/", Some("silver"), "")).await;
    assert_eq!(wrong.1.as_deref(), Some("1"));
    let gold = one(front, get("/", Some("gold"), "X-Rserpool-Level: 1\r\n")).await;
    assert_eq!((gold.0, gold.1.as_deref()), (200, Some("9")));
    assert_eq!(level_stats(&p, 9).unwrap().admitted, 1);
    assert_eq!(level_stats(&p, 1).unwrap().admitted, 3);
}

/// Two clients overload a pool of two PEs (one request at a time each, 20 ms per request:
/// 100 requests/s in all) with 75 requests/s each for 4 s. Level 9 holds about nine times
/// the tickets of level 1, so its requests hardly wait; level 1 queues, and is still served
/// at least its ticket share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_higher_level_waits_less_and_the_lower_still_gets_its_share() {
    let reg = registrar(local_config());
    let r = reg.asap_addr();
    let _pes = [
        example_http(
            r,
            POOL,
            1,
            &["--policy", "rr", "--levels", "9", "--workers", "1"],
        )
        .await,
        example_http(
            r,
            POOL,
            2,
            &["--policy", "rr", "--levels", "9", "--workers", "1"],
        )
        .await,
    ];
    let p = proxy(r, 4096).await;
    let front = p.local_addrs()[0];
    wait_for_pes(&p, 2).await;
    let window = Duration::from_secs(4);
    let start = Instant::now();
    let mut tasks = Vec::new();
    let per_client = 300;
    for i in 0..per_client {
        for client in [Some("gold"), None] {
            let at = start + window * i / per_client;
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep_until(at.into()).await;
                let (code, level, _, took) = one(front, get("/work?us=20000", client, "")).await;
                (client.is_some(), code, level, took, Instant::now())
            }));
        }
    }
    let mut lat = [Vec::new(), Vec::new()];
    let mut done_in_window = [0usize; 2];
    for t in tasks {
        let (gold, code, level, took, at) = t.await.unwrap();
        assert_eq!(code, 200, "every request is served in the end");
        assert_eq!(level.as_deref(), Some(if gold { "9" } else { "1" }));
        let k = usize::from(gold);
        lat[k].push(took.as_secs_f64());
        if at <= start + window {
            done_in_window[k] += 1;
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (low, high) = (mean(&lat[0]), mean(&lat[1]));
    eprintln!(
        "mean latency: level 9 {:.0} ms, level 1 {:.0} ms; done within the overload: {done_in_window:?}",
        high * 1e3,
        low * 1e3
    );
    assert!(high <= 0.5 * low, "level 9 {high:.3} s, level 1 {low:.3} s");
    // Level 1's ticket share against level 9: at least 100 / (100 + 999).
    let served = (done_in_window[0] + done_in_window[1]) as f64;
    let share = done_in_window[0] as f64 / served;
    assert!(
        share >= 100.0 / 1099.0,
        "level 1 got {share:.3} of {served} requests during the overload"
    );
    let s1 = level_stats(&p, 1).unwrap();
    let s9 = level_stats(&p, 9).unwrap();
    assert!(s1.queued > 0 && s1.wait_us_total / s1.queued.max(1) > 0);
    assert!(
        s9.wait_us_total / s9.admitted.max(1) < s1.wait_us_total / s1.admitted.max(1),
        "{s9:?} {s1:?}"
    );
}

/// One PE, one request at a time, a queue of four: when it is full, a level-9 request
/// pushes out the newest level-1 one (503 with Retry-After); a level-1 request that finds it
/// full has nobody lower to push out and is refused itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_sheds_the_lowest_level_first() {
    let reg = registrar(local_config());
    let r = reg.asap_addr();
    let _pe = example_http(r, POOL, 1, &["--policy", "rr", "--levels", "9"]).await;
    let p = proxy(r, 4).await;
    let front = p.local_addrs()[0];
    wait_for_pes(&p, 1).await;
    let slow = "/work?us=400000";
    // In service until the queue's part is over: 3 s, so that a slow machine still has the
    // queue full when the newcomer comes (with 400 ms it was sometimes served already).
    let busy = tokio::spawn(one(front, get("/work?us=3000000", None, "")));
    wait_until(Duration::from_secs(5), "one request in service", || {
        level_stats(&p, 1).is_some_and(|s| s.admitted == 1)
    })
    .await;
    let mut low = Vec::new();
    for n in 1..=4 {
        low.push(tokio::spawn(one(front, get(slow, None, ""))));
        wait_until(Duration::from_secs(5), "queued", || {
            level_stats(&p, 1).is_some_and(|s| s.waiting == n)
        })
        .await;
    }
    let gold = tokio::spawn(one(front, get("/", Some("gold"), "")));
    // The newest level-1 request was pushed out.
    let pushed = low.pop().unwrap().await.unwrap();
    assert_eq!(pushed.0, 503);
    assert_eq!(pushed.2.as_deref(), Some("2"), "Retry-After");
    // Full again (three of level 1 and one of level 9): a level-1 newcomer is refused.
    let refused = one(front, get("/", None, "")).await;
    assert_eq!(refused.0, 503);
    assert!(
        refused.3 < Duration::from_millis(300),
        "at once: {:?}",
        refused.3
    );
    let gold = gold.await.unwrap();
    assert_eq!(
        (gold.0, gold.1.as_deref()),
        (200, Some("9")),
        "gold: {gold:?}; level 1: {:?}; level 9: {:?}; PEs known: {}",
        level_stats(&p, 1),
        level_stats(&p, 9),
        p.pools().all()[0].len()
    );
    assert_eq!(busy.await.unwrap().0, 200);
    for t in low {
        assert_eq!(t.await.unwrap().0, 200);
    }
    let s1 = level_stats(&p, 1).unwrap();
    assert_eq!(s1.shed, 2, "{s1:?}");
    assert_eq!(level_stats(&p, 9).unwrap().shed, 0);
}

/// A TCP listener classifies by the client's source address only (the one rule that can
/// match a connection); the level shows in the proxy's counters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tcp_listener_classifies_by_source_address() {
    let reg = registrar(local_config());
    let r = reg.asap_addr();
    let _pe = example_http(r, POOL, 1, &["--policy", "rr"]).await;
    let listen = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let text = format!(
        r#"
registrars = ["{r}"]
[[listener]]
listen = "{listen}"
mode = "tcp"
pool = "{POOL}"
[levels]
[[levels.rule]]
source = "127.0.0.2"
level = 7
[[levels.rule]]
header = "x-client"
level = 9
"#
    );
    let p = Proxy::start(ProxyConfig::from_toml(&text).unwrap())
        .await
        .unwrap();
    wait_for_pes(&p, 1).await;
    for src in [[127, 0, 0, 2], [127, 0, 0, 1]] {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind(SocketAddr::from((src, 0))).unwrap();
        let stream = sock.connect(listen).await.unwrap();
        let mut c = Client::over(stream).unwrap();
        let r = c.send(&get("/", Some("gold"), "")).await.unwrap();
        assert_eq!(r.code, 200);
    }
    wait_until(Duration::from_secs(5), "both connections counted", || {
        level_stats(&p, 7).is_some_and(|s| s.finished == 1)
            && level_stats(&p, 1).is_some_and(|s| s.finished == 1)
    })
    .await;
    // The header rule cannot match a TCP connection.
    assert_eq!(level_stats(&p, 9).map(|s| s.admitted), Some(0));
}
