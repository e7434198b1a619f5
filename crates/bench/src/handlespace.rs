//! `rserpool-bench handlespace`: the seed paper's Figures 5–6 (handlespace operation throughput
//! by pool size) measured on this machine, single-threaded.
//!
//! Every operation goes through the handlespace's public API exactly as a registrar calls it,
//! with a freshly built Pool Element per registration (as a decoded message would supply).

use crate::procfs::rss_bytes;
use crate::report::{self, machine};
use anyhow::{Context, Result, bail};
use clap::Args;
use rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use rserpool_handlespace::{Config, Handlespace, PeRef, TimerKind};
use rserpool_wire::{Policy, PoolElement, PoolHandle, Protocol, TransportAddress, UserTransport};
use serde::Serialize;
use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

const OWN: u32 = 0x5250_0001;
const KEEP_ALIVE_MS: u64 = 5_000;
/// MaxElementsPerHTRequest (rsplib's default): the block size of a sync step.
const SYNC_BLOCK: usize = 128;

#[derive(Args, Debug)]
pub struct HandlespaceArgs {
    /// Pool sizes to measure (repeatable); default 1000, 10000, 100000.
    #[arg(long = "pes")]
    pes: Vec<usize>,
    /// One JSON object per pool size on stdout.
    #[arg(long)]
    json: bool,
    /// Time budget per measurement round in milliseconds (three rounds, median).
    #[arg(long, default_value_t = 200)]
    round_ms: u64,
    /// Also write the results as a Markdown section into this file (e.g. docs/BENCHMARKS.md),
    /// between generated-section markers.
    #[arg(long, value_name = "FILE")]
    markdown: Option<std::path::PathBuf>,
    /// Internal: measure resident memory for N PEs in this process and print bytes per PE.
    #[arg(long, hide = true)]
    memory_probe: Option<usize>,
}

pub fn run(args: HandlespaceArgs) -> Result<()> {
    if let Some(n) = args.memory_probe {
        println!("{}", memory_probe(n.max(1))?);
        return Ok(());
    }
    let sizes = if args.pes.is_empty() {
        vec![1_000, 10_000, 100_000]
    } else {
        args.pes
    };
    if sizes.contains(&0) {
        bail!("--pes must be at least 1");
    }
    if !args.json {
        println!("machine: {}", machine());
    }
    let mut results = Vec::new();
    for n in sizes {
        let r = run_size(n, Duration::from_millis(args.round_ms.max(10)))?;
        if args.json {
            println!("{}", serde_json::to_string(&r)?);
        } else {
            print_table(&r);
        }
        results.push(r);
    }
    if let Some(path) = args.markdown {
        report::write_section(&path, "handlespace", &markdown(&results))?;
    }
    Ok(())
}

#[derive(Debug, Serialize)]
struct SizeResult {
    pes: usize,
    reg_dereg: f64,
    rereg_rr: f64,
    rereg_lu: f64,
    rereg_timer_lu: f64,
    timer: f64,
    hr_rr_1: f64,
    hr_rr_3: f64,
    hr_rand_1: f64,
    hr_rand_3: f64,
    sync_entries: f64,
    /// Traversal plus reading each entry's PE ID (the first thing a sync step's encoder does).
    sync_entries_read: f64,
    bytes_per_pe: f64,
}

fn transport(id: u32) -> UserTransport {
    UserTransport::Address(TransportAddress {
        protocol: Protocol::TCP,
        port: (id & 0xffff) as u16,
        addresses: rserpool_wire::smallvec::smallvec![IpAddr::V4(Ipv4Addr::from(
            0x0a00_0000 | (id & 0x00ff_ffff)
        ))],
    })
}

fn element(id: u32, policy: Policy) -> PoolElement {
    PoolElement {
        id,
        home_registrar: OWN,
        registration_life: 30_000,
        user_transport: transport(id),
        policy,
        // What the registrar fills in from the PE's connection.
        asap_transport: Some(TransportAddress {
            protocol: Protocol::TCP,
            port: 40_000,
            addresses: rserpool_wire::smallvec::smallvec![IpAddr::V4(Ipv4Addr::from(
                0x0a00_0000 | (id & 0x00ff_ffff)
            ))],
        }),
    }
}

fn lu(rng: &mut Xoshiro256PlusPlus) -> Policy {
    Policy::LeastUsed {
        load: rng.next_u32(),
    }
}

/// A pool of `n` PEs with a keep-alive timer each, as a home registrar holds them.
fn build(
    n: usize,
    policy: impl Fn(&mut Xoshiro256PlusPlus) -> Policy,
    seed: u64,
) -> (Handlespace, Vec<u32>) {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut hs = Handlespace::new(Config {
        seed,
        ..Config::default()
    });
    let handle = pool_handle();
    let mut ids = Vec::with_capacity(n);
    while ids.len() < n {
        let id = rng.next_u32();
        if let Ok(r) = hs.register(&handle, element(id, policy(&mut rng)), 0)
            && r.new
        {
            let jitter = rng.next_u64() % KEEP_ALIVE_MS;
            hs.schedule_timer(
                r.pe,
                TimerKind::KeepAliveTransmission,
                KEEP_ALIVE_MS / 2 + jitter,
            );
            ids.push(id);
        }
    }
    (hs, ids)
}

fn pool_handle() -> PoolHandle {
    PoolHandle::from("BenchPool")
}

/// Runs `op` in batches until `budget` has passed, three times; the median rate in ops/s.
fn measure(budget: Duration, mut op: impl FnMut(usize)) -> f64 {
    const BATCH: usize = 1024;
    let mut rates: Vec<f64> = (0..3)
        .map(|_| {
            let start = Instant::now();
            let mut ops = 0usize;
            while start.elapsed() < budget {
                for i in 0..BATCH {
                    op(ops + i);
                }
                ops += BATCH;
            }
            ops as f64 / start.elapsed().as_secs_f64()
        })
        .collect();
    rates.sort_by(f64::total_cmp);
    rates[1]
}

/// Measured in a fresh process so that memory freed by earlier runs cannot be reused.
fn memory_probe(n: usize) -> Result<f64> {
    let before = rss_bytes(std::process::id())?;
    let (hs, _) = build(n, lu, 1);
    let after = rss_bytes(std::process::id())?;
    black_box(&hs);
    Ok((after.saturating_sub(before)) as f64 / n as f64)
}

fn memory_in_child(n: usize) -> Result<f64> {
    let exe = std::env::current_exe().context("finding own executable")?;
    let out = std::process::Command::new(exe)
        .args(["handlespace", "--memory-probe", &n.to_string()])
        .output()
        .context("running memory probe")?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.trim()
        .parse()
        .with_context(|| format!("memory probe printed {text:?}"))
}

fn run_size(n: usize, budget: Duration) -> Result<SizeResult> {
    let handle = pool_handle();
    let h = handle.as_bytes();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(42);

    // Registration/deregistration (paper §4.1): deregister a random PE when the pool is full,
    // otherwise register a new one.
    let (mut rr, mut ids) = build(n, |_| Policy::RoundRobin, 2);
    let reg_dereg = measure(budget, |_| {
        if ids.len() >= n {
            let k = (rng.next_u64() % ids.len() as u64) as usize;
            let id = ids.swap_remove(k);
            black_box(rr.deregister(h, id));
        } else {
            let id = rng.next_u32();
            if let Ok(r) = rr.register(&handle, element(id, Policy::RoundRobin), 0)
                && r.new
            {
                ids.push(id);
            }
        }
    });
    let rereg_rr = measure(budget, |_| {
        let id = ids[(rng.next_u64() % ids.len() as u64) as usize];
        black_box(
            rr.register(&handle, element(id, Policy::RoundRobin), 0)
                .ok(),
        );
    });
    let mut out: Vec<PeRef> = Vec::with_capacity(8);
    let mut hr = |hs: &mut Handlespace, items: usize| {
        measure(budget, |_| {
            out.clear();
            hs.resolve(h, items, &mut out);
            black_box(&out);
        })
    };
    let hr_rr_1 = hr(&mut rr, 1);
    let hr_rr_3 = hr(&mut rr, 3);
    let (mut rand, _) = build(n, |_| Policy::Random, 3);
    let hr_rand_1 = hr(&mut rand, 1);
    let hr_rand_3 = hr(&mut rand, 3);
    drop(rand);

    // Traversal of the owner's PEs in blocks; optionally reading each entry's PE ID.
    let mut traverse = |read: bool| {
        let mut block = Vec::with_capacity(SYNC_BLOCK);
        let mut entries = 0usize;
        let start = Instant::now();
        while start.elapsed() < budget * 3 {
            let c = rr.sync_begin(Some(OWN));
            loop {
                block.clear();
                let more = rr.sync_next(c, SYNC_BLOCK, &mut block);
                if read {
                    let ids = block.iter().map(|&r| rr.pe(r).element.id);
                    black_box(ids.fold(0, u32::wrapping_add));
                }
                black_box(&block);
                entries += block.len();
                if !more {
                    break;
                }
            }
        }
        entries as f64 / start.elapsed().as_secs_f64()
    };
    let sync_entries = traverse(false);
    let sync_entries_read = traverse(true);
    drop(rr);

    let (mut luhs, ids) = build(n, lu, 4);
    let rereg_lu = measure(budget, |_| {
        let id = ids[(rng.next_u64() % ids.len() as u64) as usize];
        black_box(luhs.register(&handle, element(id, lu(&mut rng)), 0).ok());
    });
    let mut now = 0u64;
    let rereg_timer_lu = measure(budget, |i| {
        let id = ids[(rng.next_u64() % ids.len() as u64) as usize];
        if i % 4096 == 0 {
            now += 1;
        }
        if let Ok(r) = luhs.register(&handle, element(id, lu(&mut rng)), now) {
            let jitter = rng.next_u64() % KEEP_ALIVE_MS;
            luhs.schedule_timer(
                r.pe,
                TimerKind::KeepAliveTransmission,
                now + KEEP_ALIVE_MS / 2 + jitter,
            );
        }
    });
    let refs: Vec<PeRef> = ids.iter().filter_map(|&id| luhs.find(h, id)).collect();
    let timer = measure(budget, |i| {
        let r = refs[(rng.next_u64() % refs.len() as u64) as usize];
        if i % 4096 == 0 {
            now += 1;
        }
        let jitter = rng.next_u64() % KEEP_ALIVE_MS;
        luhs.schedule_timer(
            r,
            TimerKind::KeepAliveTransmission,
            now + KEEP_ALIVE_MS / 2 + jitter,
        );
        black_box(luhs.next_timer());
    });
    drop(luhs);

    Ok(SizeResult {
        pes: n,
        reg_dereg,
        rereg_rr,
        rereg_lu,
        rereg_timer_lu,
        timer,
        hr_rr_1,
        hr_rr_3,
        hr_rand_1,
        hr_rand_3,
        sync_entries,
        sync_entries_read,
        bytes_per_pe: memory_in_child(n)?,
    })
}

fn print_table(r: &SizeResult) {
    let n = r.pes as f64;
    println!("pool of {} PEs", r.pes);
    println!(
        "  {:<34} {:>14} {:>16}",
        "operation", "ops/s", "ops per PE·s"
    );
    for (_, name, v) in fields(r) {
        println!("  {name:<36} {v:>14.0} {:>16.1}", v / n);
    }
    println!("  {:<36} {:>14.0}", "resident bytes per PE", r.bytes_per_pe);
}

/// The targets at 10,000 PEs (five times rsplib's C handlespace on this machine class).
const TARGETS: [(&str, f64, &str); 6] = [
    ("reg_dereg", 6.0e6, "1.2M reg, 1.7-2.4M dereg"),
    ("rereg_timer_lu", 5.0e6, "1.0M"),
    ("timer", 15.0e6, "3.1M"),
    ("hr_rr_1", 25.0e6, "5.0M"),
    ("hr_rand_3", 10.0e6, "10.4M (LU, 3 items)"),
    ("sync_entries", 500.0e6, "113M"),
];

fn fields(r: &SizeResult) -> [(&'static str, &'static str, f64); 11] {
    [
        ("reg_dereg", "registration + deregistration", r.reg_dereg),
        ("rereg_rr", "re-registration (RR)", r.rereg_rr),
        ("rereg_lu", "re-registration (LU, new load)", r.rereg_lu),
        (
            "rereg_timer_lu",
            "re-registration + timer (LU)",
            r.rereg_timer_lu,
        ),
        ("timer", "timer restart + next timer", r.timer),
        ("hr_rr_1", "handle resolution RR, 1 item", r.hr_rr_1),
        ("hr_rr_3", "handle resolution RR, 3 items", r.hr_rr_3),
        ("hr_rand_1", "handle resolution RAND, 1 item", r.hr_rand_1),
        ("hr_rand_3", "handle resolution RAND, 3 items", r.hr_rand_3),
        ("sync_entries", "traversal (entries/s)", r.sync_entries),
        (
            "sync_entries_read",
            "traversal + read PE ID (entries/s)",
            r.sync_entries_read,
        ),
    ]
}

fn mega(v: f64) -> String {
    format!("{:.2}M", v / 1e6)
}

/// The results as a Markdown section: command, machine, one column per pool size, and the
/// targets at 10,000 PEs where the issue sets them.
fn markdown(results: &[SizeResult]) -> String {
    use std::fmt::Write;
    let mut s = report::provenance();
    let _ = write!(s, "| operation (ops/s) |");
    for r in results {
        let _ = write!(s, " {} PEs |", r.pes);
    }
    let _ = writeln!(
        s,
        " per PE·s at largest | target at 10,000 | rsplib at 10,000 (issue) |"
    );
    let _ = writeln!(s, "|---|{}---|---|---|", "---|".repeat(results.len()));
    let Some(last) = results.last() else {
        return s;
    };
    let ten_k = results.iter().find(|r| r.pes == 10_000);
    for (i, (key, name, _)) in fields(last).iter().enumerate() {
        let _ = write!(s, "| {name} |");
        for r in results {
            let _ = write!(s, " {} |", mega(fields(r)[i].2));
        }
        let per_pe = fields(last)[i].2 / last.pes as f64;
        let target = TARGETS.iter().find(|t| t.0 == *key);
        let verdict = match (target, ten_k) {
            (Some(t), Some(r)) => {
                let v = fields(r)[i].2;
                format!(
                    "≥ {} ({})",
                    mega(t.1),
                    if v >= t.1 { "met" } else { "missed" }
                )
            }
            (Some(t), None) => format!("≥ {}", mega(t.1)),
            _ => String::new(),
        };
        let rsplib = target.map_or("", |t| t.2);
        let _ = writeln!(s, " {per_pe:.1} | {verdict} | {rsplib} |");
    }
    let _ = write!(s, "| resident bytes per PE (all) |");
    for r in results {
        let _ = write!(s, " {:.0} |", r.bytes_per_pe);
    }
    let _ = writeln!(s, " | ≤ 250 beyond addresses | |");
    if let (Some(a), Some(b)) = (ten_k, results.iter().find(|r| r.pes == 100_000)) {
        let _ = writeln!(
            s,
            "\nAt 100,000 PEs relative to 10,000 (target: no figure below 0.5):\n"
        );
        let _ = writeln!(s, "| operation | 100,000 / 10,000 |\n|---|---|");
        for (i, (_, name, _)) in fields(a).iter().enumerate() {
            let _ = writeln!(s, "| {name} | {:.2} |", fields(b)[i].2 / fields(a)[i].2);
        }
    }
    s
}
