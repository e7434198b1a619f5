//! `rserpool-bench push`: how fast a credit change reaches a subscribed pool user (docs/CREDITS.md,
//! target: ≤ 20 ms at the 99th percentile, loopback, 1,000 reports/s across the pool).
//!
//! A registrar (in a thread of its own, its mio loop as in `rserpool registrar`), `--pes`
//! library pool elements with policy `credits`, and one pool user subscribed to the pool (the
//! proxy's path: `PoolUserConfig::subscribe`) run on loopback. The PEs report new credits at
//! `--rate` reports/s in all, round robin; each report is a re-registration, and the registrar
//! pushes the pool after each. The latency of a report is from the PE's `update_policy` call
//! to the pool user holding the pushed pool with that value. A report that a newer one of the
//! same PE overtook before a push (coalesced) is counted apart.

use crate::net::{free_port, local};
use crate::report;
use anyhow::{Context, Result, anyhow};
use clap::Args;
use rserpool_asap::{PoolElement, PoolElementConfig, PoolUser, PoolUserConfig};
use rserpool_registrar::{Config, RegistrarThread, StatusListen};
use rserpool_wire::{Policy, PoolHandle};
use std::collections::HashMap;
use std::fmt::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct PushArgs {
    /// Pool elements reporting credits.
    #[arg(long, default_value_t = 10)]
    pub pes: u32,
    /// Credit reports per second, across the pool.
    #[arg(long, default_value_t = 1000)]
    pub rate: u32,
    /// How long reports are sent.
    #[arg(long, default_value_t = 10)]
    pub duration_s: u64,
    /// Through an ENRP peer: the PEs register at one registrar, the pool user subscribes at
    /// another, which learns each change by ENRP.
    #[arg(long)]
    pub via_peer: bool,
    /// The registrars' `enrp-batch-ms` (at most one ENRP write per peer per interval).
    #[arg(long, default_value_t = 50)]
    pub enrp_batch_ms: u64,
    /// Write the results as a Markdown section into this file (e.g. docs/CREDITS.md).
    #[arg(long)]
    pub markdown: Option<PathBuf>,
}

const POOL: &str = "PushBench";
const CAPACITY: u32 = 1_000_000;

pub fn run(args: PushArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let registrar = |enrp: SocketAddr, peer: Vec<SocketAddr>| -> Result<RegistrarThread> {
        RegistrarThread::start(Config {
            asap: "127.0.0.1:0".parse()?,
            enrp: enrp.into(),
            peer: peer.into_iter().map(Into::into).collect(),
            status: StatusListen::given(None),
            enrp_batch_ms: args.enrp_batch_ms,
            ..Config::default()
        })
        .context("starting a registrar")
    };
    let home_enrp = local(free_port()?);
    let home = registrar(home_enrp, Vec::new())?;
    let peer = match args.via_peer {
        true => Some(registrar(local(free_port()?), vec![home_enrp])?),
        false => None,
    };
    let pu_registrar = peer.as_ref().unwrap_or(&home).asap_addr();
    let out = rt.block_on(measure(&args, home.asap_addr(), pu_registrar))?;
    print!("{out}");
    if let Some(path) = &args.markdown {
        let section = if args.via_peer {
            "push via peer"
        } else {
            "push"
        };
        report::write_section(path, section, &format!("{}{out}", report::provenance()))?;
        println!("written into {}", path.display());
    }
    Ok(())
}

/// PEs register at `registrar`, the pool user subscribes at `pu_registrar`.
async fn measure(
    args: &PushArgs,
    registrar: SocketAddr,
    pu_registrar: SocketAddr,
) -> Result<String> {
    let handle = PoolHandle::from(POOL);
    let mut pes = Vec::new();
    for i in 0..args.pes.max(1) {
        let target = SocketAddr::from(([127, 0, 0, 1], 10_000 + i as u16));
        let mut cfg = PoolElementConfig::new(
            POOL,
            target,
            Policy::Credits {
                credits: CAPACITY,
                capacity: CAPACITY,
            },
        );
        cfg.registrars = vec![registrar];
        cfg.id = Some(0x5000 + i);
        let pe = PoolElement::start(cfg)?;
        pe.wait_registered(Duration::from_secs(5))
            .await
            .map_err(|e| anyhow!("PE {i} did not register: {e}"))?;
        pes.push(pe);
    }
    let mut pu = PoolUser::new(PoolUserConfig {
        registrars: vec![pu_registrar],
        subscribe: true,
        ..PoolUserConfig::default()
    })?;
    // A peer registrar learns the pool once it has synchronised with the other.
    let known = Instant::now();
    loop {
        let n = pu.pool_elements(&handle).await.map_or(0, |(_, v)| v.len());
        if n == pes.len() {
            break;
        }
        if known.elapsed() > Duration::from_secs(20) {
            return Err(anyhow!(
                "the pool user's registrar has {n} PEs, not {}",
                pes.len()
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // (PE ID, credits) → when it was reported.
    let mut sent: HashMap<(u32, u32), Instant> = HashMap::new();
    let mut seen: HashMap<u32, u32> = HashMap::new();
    let mut latencies: Vec<Duration> = Vec::new();
    let mut pushes = 0u64;
    let interval = Duration::from_secs_f64(1.0 / f64::from(args.rate.max(1)));
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let end = Instant::now() + Duration::from_secs(args.duration_s);
    let drain_until = end + Duration::from_secs(1);
    let (mut reports, mut seq) = (0u64, 0u32);
    loop {
        let now = Instant::now();
        if now >= drain_until {
            break;
        }
        tokio::select! {
            _ = ticker.tick(), if now < end => {
                let k = (reports % pes.len() as u64) as usize;
                seq = seq.wrapping_add(1);
                let credits = CAPACITY - 1 - (seq % (CAPACITY - 1));
                let pe = &pes[k];
                sent.insert((pe.id(), credits), Instant::now());
                pe.update_policy(Policy::Credits { credits, capacity: CAPACITY });
                reports += 1;
            }
            r = pu.next_push() => {
                let at = Instant::now();
                pushes += 1;
                for p in r.pool_elements {
                    let Policy::Credits { credits, .. } = p.policy else { continue };
                    if seen.insert(p.id, credits) == Some(credits) {
                        continue;
                    }
                    if let Some(t) = sent.remove(&(p.id, credits)) {
                        latencies.push(at - t);
                    }
                }
            }
            () = tokio::time::sleep_until(tokio::time::Instant::from_std(drain_until)) => {}
        }
    }
    let delivered = latencies.len() as u64;
    latencies.sort();
    let q = |f: f64| {
        latencies
            .get(((latencies.len() as f64 * f) as usize).min(latencies.len().saturating_sub(1)))
            .map_or(f64::NAN, |d| d.as_secs_f64() * 1e3)
    };
    let secs = args.duration_s.max(1) as f64;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} PEs with policy `credits` report {:.0} credit changes/s in all for {} s (asked: {}/s) to one registrar; one pool user subscribed to the pool {}.\n",
        pes.len(),
        reports as f64 / secs,
        args.duration_s,
        args.rate,
        if args.via_peer {
            format!(
                "at another registrar, its ENRP peer (enrp-batch-ms {})",
                args.enrp_batch_ms
            )
        } else {
            "at the same registrar".to_string()
        }
    );
    let _ = writeln!(out, "| figure | value |\n|---|---|");
    let _ = writeln!(out, "| reports | {reports} |");
    let _ = writeln!(
        out,
        "| pushes received | {pushes} ({:.0}/s) |",
        pushes as f64 / secs
    );
    let _ = writeln!(
        out,
        "| reports seen by the pool user | {delivered} (the others were overtaken by a newer report of the same PE before a push) |"
    );
    let _ = writeln!(
        out,
        "| report → pool user, ms | p50 {:.2}, p90 {:.2}, p99 {:.2}, max {:.2} |",
        q(0.5),
        q(0.9),
        q(0.99),
        q(1.0)
    );
    let _ = writeln!(out);
    for pe in pes {
        pe.stop().await;
    }
    Ok(out)
}
