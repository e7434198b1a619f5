//! Overload is not death, side by side with HAProxy: three `rserpool example http` PEs with
//! 1, 2 and 4 workers and accept queues of 4 take bursts that alternate between 130 % and
//! 70 % of the pool's capacity (100 % on average) through `rserpool proxy` with each
//! selection, and through HAProxy `balance leastconn` with `retries 3` and `option
//! redispatch` (Debian's `haproxy`; `.ci/run` installs it). A PE whose accept queue is full
//! drops SYNs and the proxy's connect times out: it is busy, not dead. The proxy must eject no
//! PE, and fail no more requests than HAProxy in the same test (within a noise margin of 1 %
//! of the requests, for a 2-core machine running both). A selection that fails more is
//! measured once more right after HAProxy once more, and fails the test only if it does so
//! again: a noisy moment of the machine hits one run, not two.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{BIN, KillOnDrop, fast_config, free_port, metric, registrar, scrape, wait_for};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const WORKERS: [usize; 3] = [1, 2, 4];
const BACKLOG: &str = "4";
/// Work per request; 7 workers make the pool's capacity 350 requests/s.
const COST_US: u64 = 20_000;
const LOAD: Duration = Duration::from_secs(3);
/// A request not answered 200 in full within this failed.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(5);

/// The PEs of one run, registered in `pool` with `flags` (and `--weight` = workers for WRR).
async fn pes(
    reg: SocketAddr,
    pool: &str,
    policy: &[&str],
    weighted: bool,
) -> Vec<(KillOnDrop, SocketAddr)> {
    let mut v = Vec::new();
    for (i, w) in WORKERS.iter().enumerate() {
        let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let w = w.to_string();
        let mut cmd = Command::new(BIN);
        cmd.args([
            "example",
            "http",
            "--pool",
            pool,
            "--id",
            &(i + 1).to_string(),
        ])
        .args([
            "--listen",
            &addr.to_string(),
            "--registrar",
            &reg.to_string(),
        ])
        .args(["--workers", &w, "--backlog", BACKLOG])
        .args(policy);
        if weighted {
            cmd.args(["--weight", &w]);
        }
        let child = cmd
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        v.push((KillOnDrop(child), addr));
    }
    for (_, addr) in &v {
        let addr = *addr;
        wait_for(Duration::from_secs(10), "the PE listens", || async move {
            tokio::net::TcpStream::connect(addr).await.is_ok()
        })
        .await;
    }
    v
}

/// One request on a new connection: whether it was answered 200 in full in time.
async fn request(front: SocketAddr, seq: usize) -> bool {
    request_code(front, seq).await == 200
}

/// One request's status code (0: no answer in time, 1: a short one); with `CASCADE_DEBUG` set,
/// each one not 200 is printed.
async fn request_code(front: SocketAddr, seq: usize) -> u16 {
    let r = answer_code(front, seq).await;
    if r != 200 && std::env::var_os("CASCADE_DEBUG").is_some() {
        eprintln!("request {seq}: {r}");
    }
    r
}

async fn answer_code(front: SocketAddr, seq: usize) -> u16 {
    let go = async {
        let mut s = tokio::net::TcpStream::connect(front).await.ok()?;
        let req = format!(
            "GET /work?us={COST_US}&bytes=100&r={seq} HTTP/1.1\r\nHost: cascade\r\nConnection: close\r\n\r\n"
        );
        s.write_all(req.as_bytes()).await.ok()?;
        let mut v = Vec::new();
        s.read_to_end(&mut v).await.ok()?;
        let code = std::str::from_utf8(v.get(9..12)?).ok()?.parse().ok()?;
        Some(if code == 200 && v.len() < 100 {
            1
        } else {
            code
        })
    };
    tokio::time::timeout(CLIENT_TIMEOUT, go)
        .await
        .ok()
        .flatten()
        .unwrap_or(0)
}

/// What the failed requests got: status code (0: no answer in time, 1: a short one) and count.
type Failures = std::collections::BTreeMap<u16, usize>;

/// Open-loop bursts through `front` for [`LOAD`]: requests, failed, and how they failed.
async fn bursts(front: SocketAddr) -> (usize, usize, Failures) {
    let capacity = WORKERS.iter().sum::<usize>() as f64 * 1e6 / COST_US as f64;
    let failed = Arc::new(std::sync::Mutex::new(Failures::new()));
    let mut tasks = Vec::new();
    let start = tokio::time::Instant::now();
    let mut at = Duration::ZERO;
    let mut seq = 0;
    while at < LOAD {
        // 300 ms at 130 %, 300 ms at 70 %.
        let high = (at.as_millis() / 300).is_multiple_of(2);
        let rate = capacity * if high { 1.3 } else { 0.7 };
        tokio::time::sleep_until(start + at).await;
        let failed = failed.clone();
        tasks.push(tokio::spawn(async move {
            let code = request_code(front, seq).await;
            if code != 200 {
                *failed.lock().unwrap().entry(code).or_default() += 1;
            }
        }));
        seq += 1;
        at += Duration::from_secs_f64(1.0 / rate);
    }
    for t in tasks {
        let _ = t.await;
    }
    let failed = failed.lock().unwrap().clone();
    (seq, failed.values().sum(), failed)
}

/// The proxy with `select` in front of `pool`: its process, front and status addresses.
async fn proxy(
    reg: SocketAddr,
    pool: &str,
    select: &str,
    dir: &std::path::Path,
) -> (KillOnDrop, SocketAddr, SocketAddr) {
    let front = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let status = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let cfg = format!(
        "registrars = [\"{reg}\"]\nrefresh-ms = 200\nstatus = \"{status}\"\n\
         [[listener]]\nlisten = \"{front}\"\nmode = \"http\"\npool = \"{pool}\"\n\
         [pool.{pool}]\nselect = \"{select}\"\nhash-key = \"path\"\nqueue-timeout-ms = 4000\nqueue = 8192\n"
    );
    let path = dir.join(format!("{pool}.toml"));
    std::fs::write(&path, cfg).unwrap();
    let child = Command::new(BIN)
        .arg("proxy")
        .arg("--config")
        .arg(&path)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let p = KillOnDrop(child);
    let sees = |status| async move {
        let (code, body) = rserpool_status::get(status, "/status").await.ok()?;
        let v: serde_json::Value = serde_json::from_slice(&body).ok()?;
        let n = v["pools"][0]["pool_elements"].as_array()?.len();
        Some(code == 200 && n == WORKERS.len())
    };
    wait_for(
        Duration::from_secs(10),
        "the proxy sees the three PEs",
        || async move { sees(status).await.unwrap_or(false) },
    )
    .await;
    (p, front, status)
}

/// HAProxy `balance leastconn` with `retries 3` and `option redispatch` in front of PEs of its
/// own in `pool`: its bursts' requests, failed, and how.
async fn haproxy_bursts(
    reg: SocketAddr,
    pool: &str,
    dir: &std::path::Path,
) -> (usize, usize, Failures) {
    let theirs = pes(reg, pool, &["--policy", "rr"], false).await;
    let front = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let servers: String = theirs
        .iter()
        .zip(WORKERS)
        .enumerate()
        .map(|(i, ((_, a), w))| format!("    server s{} {a} weight {}\n", i + 1, w * 10))
        .collect();
    let cfg = format!(
        "global\n    maxconn 8000\n\
         defaults\n    mode http\n    timeout connect 1s\n    timeout client 30s\n    timeout server 30s\n    retries 3\n    option redispatch\n\
         frontend web\n    bind {front}\n    default_backend pool\n\
         backend pool\n    balance leastconn\n{servers}"
    );
    let path = dir.join(format!("{pool}.cfg"));
    std::fs::write(&path, cfg).unwrap();
    let _haproxy = KillOnDrop(
        Command::new("haproxy")
            .arg("-db")
            .arg("-f")
            .arg(&path)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for(Duration::from_secs(10), "HAProxy answers", || async move {
        request(front, 0).await
    })
    .await;
    let (n, failed, how) = bursts(front).await;
    eprintln!(
        "HAProxy leastconn, retries 3, redispatch: {failed} of {n} failed (by status: {how:?})"
    );
    (n, failed, how)
}

/// What one selection's run came to.
struct Run {
    n: usize,
    failed: usize,
    how: Failures,
    ejected: f64,
}

/// The proxy with `select` in front of PEs of its own registered with `policy`.
async fn scheme_bursts(
    reg: SocketAddr,
    name: &str,
    (policy, weighted, select): (&[&str], bool, &str),
    dir: &std::path::Path,
    round: usize,
) -> Run {
    let pool = format!("Cascade{}{round}", name.replace('-', ""));
    let _ours = pes(reg, &pool, policy, weighted).await;
    let (_p, front, status) = proxy(reg, &pool, select, dir).await;
    let started = Instant::now();
    let (n, failed, how) = bursts(front).await;
    let samples = scrape(status).await;
    let ejected = metric(&samples, "rserpool_proxy_ejections_total", &[]);
    let busy = metric(&samples, "rserpool_proxy_pe_busy_total", &[]);
    eprintln!(
        "{name}: {failed} of {n} failed (by status: {how:?}), {ejected} ejections, {busy} \
         times busy ({:?})",
        started.elapsed()
    );
    Run {
        n,
        failed,
        how,
        ejected,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bursts_at_full_load_eject_nothing_and_fail_no_more_than_haproxy() {
    if !common::haproxy_here() {
        return;
    }
    let reg = registrar(fast_config());
    let asap = reg.asap_addr();
    let dir = std::env::temp_dir().join(format!("rserpool-cascade-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    // HAProxy first, on PEs of their own.
    let (n, haproxy_failed, _) = haproxy_bursts(asap, "CascadeHaproxy0", &dir).await;
    let margin = n / 100;

    let schemes: [(&str, &[&str], bool, &str); 8] = [
        ("rr", &["--policy", "rr"], false, "policy"),
        ("wrr", &["--policy", "wrr"], true, "policy"),
        (
            "least-connections",
            &["--policy", "rr"],
            false,
            "least-connections",
        ),
        ("p2c", &["--policy", "rr"], false, "p2c"),
        ("prequal", &["--policy", "rr"], false, "prequal"),
        ("maglev", &["--policy", "rr"], false, "maglev"),
        ("ring-hash", &["--policy", "rr"], false, "ring-hash"),
        (
            "dpr",
            &["--policy", "credits", "--credit-reporting", "dpr"],
            false,
            "policy",
        ),
    ];
    let mut report = Vec::new();
    for (name, policy, weighted, select) in schemes {
        let mut run = scheme_bursts(asap, name, (policy, weighted, select), &dir, 0).await;
        let mut baseline = haproxy_failed;
        if run.failed > baseline + margin {
            // The machine's noise (another tenant, the disk writing the build out) can hit one
            // scheme's few seconds and not HAProxy's: measured again, right after HAProxy
            // again. A scheme worse than HAProxy is worse twice. An ejection counts from
            // either run.
            eprintln!("{name}: measured again, after HAProxy again");
            baseline = haproxy_bursts(
                asap,
                &format!("CascadeHaproxy{}", name.replace('-', "")),
                &dir,
            )
            .await
            .1;
            let first_ejected = run.ejected;
            run = scheme_bursts(asap, name, (policy, weighted, select), &dir, 1).await;
            run.ejected += first_ejected;
        }
        report.push((name, run, baseline));
    }
    let _ = std::fs::remove_dir_all(&dir);
    for (name, run, baseline) in report {
        let Run {
            n,
            failed,
            how,
            ejected,
        } = run;
        assert_eq!(ejected, 0.0, "{name}: a busy PE was ejected as dead");
        assert!(
            failed <= baseline + margin,
            "{name}: {failed} of {n} failed (by status: {how:?}), HAProxy {baseline}"
        );
    }
}
