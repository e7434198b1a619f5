//! Takeover of pool elements that know a single registrar (docs/RELIABILITY.md), with real processes: three
//! `rserpool registrar`s, each with the other two as `--peer`, and three `rserpool example echo`
//! that know only the first. It is killed (SIGKILL); a survivor takes its PEs over and they stay
//! registered everywhere, answering keep-alives, without registering again. And a PE that knows
//! only a dead registrar, and is not taken over, registers once a registrar is reachable there
//! or announces itself. With short timers the new home is killed too, and the last registrar
//! takes the PEs over. Before the kill, a forged takeover (`rserpool attack takeover`) moves
//! none of them.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{BIN, Logged, free_port, signal, wait_for, wait_until};

use rustix::process::Signal;
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

const POOL: &str = "EnrpPool";
/// The registrars' log: the survivors' "re-registered" lines are at debug level.
const REGISTRAR_LOG: &str = "info,rserpool_registrar=debug";
/// The PEs' log: failed connection attempts are at debug level.
const PE_LOG: &str = "info,rserpool_asap=debug";

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// `rserpool registrar` arguments: ASAP and ENRP addresses, peers, then `extra` flags.
fn registrar_args(
    asap: SocketAddr,
    enrp: SocketAddr,
    peers: &[SocketAddr],
    extra: &[String],
) -> Vec<String> {
    let mut args = vec![
        "registrar".to_string(),
        "--asap".into(),
        asap.to_string(),
        "--enrp".into(),
        enrp.to_string(),
        // A port of its own: the default status address belongs to the `up` test.
        "--status".into(),
        "127.0.0.1:0".into(),
    ];
    for p in peers {
        args.push("--peer".into());
        args.push(p.to_string());
    }
    args.extend_from_slice(extra);
    args
}

/// A registrar process and its ID (from its start-up log line).
async fn start_registrar(name: &str, args: &[String]) -> (Logged, u32) {
    let r = Logged::spawn(name, args, REGISTRAR_LOG);
    let id = r
        .hex_after("registrar ", "listening for ASAP", Duration::from_secs(10))
        .await;
    (r, id)
}

/// An `rserpool example echo` in the pool, knowing only `registrar` (and the announces at
/// `announce_listen`), and its PE identifier.
async fn start_pe(
    name: &str,
    registrar: SocketAddr,
    announce_listen: Option<SocketAddr>,
) -> (Logged, u32) {
    let mut args: Vec<String> = ["example", "echo", "--pool", POOL, "--registrar"]
        .map(String::from)
        .to_vec();
    args.push(registrar.to_string());
    if let Some(a) = announce_listen {
        args.push("--announce-listen".into());
        args.push(a.to_string());
    }
    let pe = Logged::spawn(name, &args, PE_LOG);
    let id = pe
        .hex_after("is PE ", "is PE", Duration::from_secs(10))
        .await;
    (pe, id)
}

/// PE identifier -> home registrar ID, as `rserpool resolve --json` at `registrar` lists them.
async fn homes(registrar: SocketAddr) -> Result<BTreeMap<u32, u32>, String> {
    let reg = registrar.to_string();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(BIN)
            .args([
                "resolve",
                POOL,
                "--items",
                "100",
                "--json",
                "--registrar",
                &reg,
            ])
            .env("RUST_LOG", "off")
            .output()
    })
    .await
    .unwrap()
    .map_err(|e| format!("rserpool resolve: {e}"))?;
    if !out.status.success() {
        let why = String::from_utf8_lossy(&out.stderr);
        return Err(format!("resolve at {registrar}: {}", why.trim()));
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("resolve at {registrar}: bad JSON: {e}"))?;
    let pes = v["pool_elements"].as_array().cloned().unwrap_or_default();
    Ok(pes
        .iter()
        .map(|p| {
            let n = |k: &str| u32::try_from(p[k].as_u64().unwrap()).unwrap();
            (n("id"), n("home_registrar"))
        })
        .collect())
}

/// `registrar` resolves PE `id`.
async fn resolves(registrar: SocketAddr, id: u32) -> bool {
    homes(registrar).await.is_ok_and(|h| h.contains_key(&id))
}

/// Every registrar in `at` resolves exactly `pes`, each homed at one of `owners`.
async fn owned_by(at: &[SocketAddr], pes: &BTreeSet<u32>, owners: &[u32]) -> Result<(), String> {
    for &r in at {
        let h = homes(r).await?;
        let ids: BTreeSet<u32> = h.keys().copied().collect();
        if &ids != pes {
            return Err(format!("{r} resolves {ids:x?}, not {pes:x?}"));
        }
        if let Some((pe, home)) = h.iter().find(|(_, home)| !owners.contains(home)) {
            return Err(format!(
                "{r}: PE {pe:#010x} homed at {home:#010x}, not at {owners:x?}"
            ));
        }
    }
    Ok(())
}

/// The scenario. `timers`: the registrars' keep-alive interval and timeout (`None`:
/// their defaults). With `rounds` 2, the registrar that took the PEs over is killed next.
async fn the_pes_of_a_killed_registrar_stay_with_a_survivor(
    timers: Option<(Duration, Duration)>,
    rounds: usize,
) {
    let started = Instant::now();
    let asap: Vec<SocketAddr> = (0..3).map(|_| loopback(free_port())).collect();
    let enrp: Vec<SocketAddr> = (0..3).map(|_| loopback(free_port())).collect();
    let defaults = rserpool_registrar::Config::default();
    let (interval, timeout) = timers.unwrap_or((
        Duration::from_millis(defaults.keep_alive_interval_ms),
        Duration::from_millis(defaults.keep_alive_timeout_ms),
    ));
    let timers: Vec<String> = match timers {
        Some(_) => vec![
            "--keep-alive-interval-ms".into(),
            interval.as_millis().to_string(),
            "--keep-alive-timeout-ms".into(),
            timeout.as_millis().to_string(),
        ],
        None => Vec::new(),
    };
    let mut regs = Vec::new();
    let mut ids = Vec::new();
    for i in 0..3 {
        let peers: Vec<SocketAddr> = (0..3).filter(|&j| j != i).map(|j| enrp[j]).collect();
        let args = registrar_args(asap[i], enrp[i], &peers, &timers);
        let (r, id) = start_registrar(&format!("registrar{i}"), &args).await;
        regs.push(r);
        ids.push(id);
    }
    let mut pes = Vec::new();
    for k in 0..3 {
        pes.push(start_pe(&format!("pe{k}"), asap[0], None).await);
    }
    let pe_ids: BTreeSet<u32> = pes.iter().map(|(_, id)| *id).collect();
    let t = wait_for(
        Duration::from_secs(30),
        "the PEs at every registrar, homed at the first",
        || owned_by(&asap, &pe_ids, &ids[..1]),
    )
    .await;
    eprintln!("3 PEs registered at the first registrar and replicated in {t:?}");

    // A forged takeover first (docs/SECURITY.md): every PE answers, asks its home, stays.
    let out = Command::new(BIN)
        .args(["attack", "takeover", "--pool", POOL, "--hold-ms", "2000"])
        .args(["--registrar", &asap[1].to_string()])
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{said}");
    assert_eq!(said.matches(": Refused").count(), 3, "{said}");
    owned_by(&asap, &pe_ids, &ids[..1]).await.unwrap();
    for (pe, id) in &pes {
        let refused = pe.lines_with("refused: home registrar");
        assert_eq!(refused.len(), 1, "PE {id:#010x}, logged once: {refused:?}");
    }

    let mut live = vec![0, 1, 2];
    // PE -> takeovers it should have logged.
    let mut takeovers: BTreeMap<u32, usize> = BTreeMap::new();
    for round in 0..rounds {
        // Kill the home of the first PE (in the first round, the first registrar).
        let now = homes(asap[live[0]]).await.unwrap();
        let home = now[pe_ids.first().unwrap()];
        for (pe, h) in &now {
            *takeovers.entry(*pe).or_default() += usize::from(*h == home);
        }
        let victim = ids.iter().position(|&i| i == home).unwrap();
        assert!(round > 0 || victim == 0);
        signal(&regs[victim].proc, Signal::KILL);
        live.retain(|&i| i != victim);
        let at: Vec<SocketAddr> = live.iter().map(|&i| asap[i]).collect();
        let owners: Vec<u32> = live.iter().map(|&i| ids[i]).collect();
        let t = wait_for(
            Duration::from_secs(30),
            "every PE owned by a survivor and resolvable at each",
            || owned_by(&at, &pe_ids, &owners),
        )
        .await;
        eprintln!("registrar {victim} killed: its PEs owned by a survivor {t:?} later");

        // They answer their new home's keep-alives: still there after more than a keep-alive
        // interval and timeout (without answers they would be gone by then).
        let hold = interval + timeout + Duration::from_secs(1);
        let from = Instant::now();
        while from.elapsed() < hold {
            if let Err(e) = owned_by(&at, &pe_ids, &owners).await {
                panic!("{:?} after the takeover: {e}", from.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    // Never registered again: no other registrar got a registration of these PEs (their logs
    // name each new and repeated one), and each PE logged a single registration and its
    // takeovers.
    for (i, r) in regs.iter().enumerate().skip(1) {
        for id in &pe_ids {
            let pe = format!("PE {id:#010x}");
            let again: Vec<String> = r
                .lines_with(&pe)
                .into_iter()
                .filter(|l| l.contains("registered in pool") || l.contains("re-registered"))
                .collect();
            assert!(
                again.is_empty(),
                "registrar {i} got registrations: {again:?}"
            );
        }
    }
    for (pe, id) in &pes {
        let registered = pe.lines_with("registered in pool");
        assert_eq!(registered.len(), 1, "PE {id:#010x}: {registered:?}");
        let taken = pe.lines_with("taken over by registrar");
        assert_eq!(taken.len(), takeovers[id], "PE {id:#010x}: {taken:?}");
    }
    eprintln!("done in {:?}", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pes_knowing_only_a_killed_registrar_stay_with_a_survivor() {
    the_pes_of_a_killed_registrar_stay_with_a_survivor(None, 1).await;
}

/// With short timers, the new home is killed too: the PEs are taken over by the last registrar.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pes_knowing_only_a_killed_registrar_stay_with_a_survivor_short_timers() {
    let short = (Duration::from_millis(300), Duration::from_millis(300));
    the_pes_of_a_killed_registrar_stay_with_a_survivor(Some(short), 2).await;
}

/// A PE registered at a lone registrar that is then killed; returns the PE and its ID once it
/// has failed to reach the registrar a few times (backing off in between).
async fn pe_of_a_dead_registrar(
    asap: SocketAddr,
    announce_listen: Option<SocketAddr>,
) -> (Logged, u32) {
    let (reg, _) = start_registrar(
        "registrar",
        &registrar_args(asap, loopback(free_port()), &[], &[]),
    )
    .await;
    let (pe, id) = start_pe("pe", asap, announce_listen).await;
    wait_for(Duration::from_secs(10), "the PE registered", || {
        resolves(asap, id)
    })
    .await;
    signal(&reg.proc, Signal::KILL);
    drop(reg);
    let failed = format!("registrar {asap}:");
    wait_until(Duration::from_secs(20), "three failed attempts", || {
        pe.lines_with(&failed).len() >= 3
    })
    .await;
    (pe, id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pe_knowing_only_a_dead_registrar_registers_when_one_is_back_there() {
    let asap = loopback(free_port());
    let (_pe, id) = pe_of_a_dead_registrar(asap, None).await;
    let args = registrar_args(asap, loopback(free_port()), &[], &[]);
    let (_reg, _) = start_registrar("restarted", &args).await;
    let t = wait_for(Duration::from_secs(20), "the PE registered again", || {
        resolves(asap, id)
    })
    .await;
    eprintln!("PE registered at the restarted registrar after {t:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pe_knowing_only_a_dead_registrar_registers_at_an_announced_one() {
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let listen = udp.local_addr().unwrap();
    drop(udp);
    let (_pe, id) = pe_of_a_dead_registrar(loopback(free_port()), Some(listen)).await;
    let other = loopback(free_port());
    let announce = [
        "--announce".to_string(),
        listen.to_string(),
        "--announce-interval-ms".into(),
        "200".into(),
    ];
    let args = registrar_args(other, loopback(free_port()), &[], &announce);
    let (_reg, _) = start_registrar("announced", &args).await;
    let t = wait_for(
        Duration::from_secs(20),
        "the PE registered at the announced registrar",
        || resolves(other, id),
    )
    .await;
    eprintln!("PE registered at the announced registrar after {t:?}");
}
