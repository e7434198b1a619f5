//! `rserpool bench …`: benchmarks that write their results, with command and machine, into docs/.

pub mod handlespace;
pub mod plot;
pub mod proxy;
pub mod registrar;

use anyhow::{Result, bail};
use clap::Subcommand;
use std::time::Duration;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Handlespace operation throughput (the seed paper's Figures 5-6).
    Handlespace {
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
    },
    /// Registrar CPU, memory and latency under N PEs and M PUs (the seed's Figures 7-8).
    Registrar(registrar::RegistrarBenchArgs),
    /// The proxy side by side with HAProxy, nginx and direct (issue 5's comparison).
    Proxy(proxy::ProxyBenchArgs),
    /// Internal: the simulated PEs and PUs of `bench registrar`.
    #[command(hide = true)]
    LoadGen(registrar::LoadGenArgs),
}

pub fn run(what: BenchCommand) -> Result<()> {
    match what {
        BenchCommand::Registrar(a) => registrar::run(a),
        BenchCommand::LoadGen(a) => registrar::load_gen(a),
        BenchCommand::Proxy(a) => proxy::run(a),
        BenchCommand::Handlespace {
            pes,
            json,
            round_ms,
            markdown,
            memory_probe,
        } => {
            if let Some(n) = memory_probe {
                println!("{}", handlespace::memory_probe(n.max(1))?);
                return Ok(());
            }
            let sizes = if pes.is_empty() {
                vec![1_000, 10_000, 100_000]
            } else {
                pes
            };
            if sizes.contains(&0) {
                bail!("--pes must be at least 1");
            }
            if !json {
                println!("machine: {}", handlespace::machine());
            }
            let mut results = Vec::new();
            for n in sizes {
                let r = handlespace::run_size(n, Duration::from_millis(round_ms.max(10)))?;
                if json {
                    println!("{}", serde_json::to_string(&r)?);
                } else {
                    handlespace::print_table(&r);
                }
                results.push(r);
            }
            if let Some(path) = markdown {
                let section = handlespace::markdown(&results, &command_line());
                handlespace::write_markdown(&path, &section)?;
            }
            Ok(())
        }
    }
}

/// The machine's CPU counters (`/proc/stat`, all cores): (busy, total) in clock ticks.
pub fn machine_cpu_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal ...; idle and iowait are not busy.
    let total: u64 = ticks.iter().take(8).sum();
    let idle = ticks.get(3)? + ticks.get(4)?;
    Some((total - idle, total))
}

/// The share of the machine's CPU that was busy since `since` (from [`machine_cpu_ticks`]).
pub fn machine_busy_since(since: Option<(u64, u64)>) -> Option<f64> {
    let ((b0, t0), (b1, t1)) = since.zip(machine_cpu_ticks())?;
    (t1 > t0).then(|| (b1 - b0) as f64 / (t1 - t0) as f64)
}

/// The command as the user typed it, for the results file.
pub fn command_line() -> String {
    let args = std::env::args().skip(1).collect::<Vec<_>>().join(" ");
    format!("rserpool {args}")
}

/// Replaces the generated section `name` of a Markdown file (between its markers), appending
/// the section if the file does not have it yet.
pub fn write_section(path: &std::path::Path, name: &str, section: &str) -> Result<()> {
    use anyhow::Context;
    let begin = format!("<!-- bench {name}: begin (generated) -->");
    let end = format!("<!-- bench {name}: end -->");
    let old = std::fs::read_to_string(path).unwrap_or_default();
    let block = format!("{begin}\n{section}{end}");
    let new = match (old.find(&begin), old.find(&end)) {
        (Some(b), Some(e)) if e > b => format!("{}{block}{}", &old[..b], &old[e + end.len()..]),
        _ => format!("{old}\n{block}\n"),
    };
    std::fs::write(path, new).with_context(|| format!("writing {}", path.display()))
}
