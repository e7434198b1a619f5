//! `rserpool-bench`: the benchmarks of rserpool, a binary of their own so that the product
//! does not ship them. Each writes its results, with command and machine, into docs/:
//! `cargo run --release -p rserpool-bench -- handlespace|registrar|proxy …`.

mod handlespace;
mod plot;
mod product;
mod proxy;
mod registrar;

use anyhow::Result;
use clap::{Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "rserpool-bench",
    about = "Benchmarks of rserpool; results, with command and machine, go into docs/"
)]
struct Cli {
    /// The rserpool binary to measure [default: the one next to this executable, which
    /// `cargo run` builds first].
    #[arg(long, global = true, value_name = "PATH")]
    rserpool: Option<PathBuf>,
    #[command(subcommand)]
    command: BenchCommand,
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Handlespace operation throughput (the seed paper's Figures 5-6).
    Handlespace(handlespace::HandlespaceArgs),
    /// Registrar CPU, memory and latency under N PEs and M PUs (the seed's Figures 7-8).
    Registrar(registrar::RegistrarBenchArgs),
    /// The proxy side by side with HAProxy, nginx and direct (issue 5's comparison).
    Proxy(proxy::ProxyBenchArgs),
    /// Internal: the simulated PEs and PUs of `registrar`.
    #[command(hide = true)]
    LoadGen(registrar::LoadGenArgs),
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        BenchCommand::Handlespace(a) => handlespace::run(a),
        BenchCommand::Registrar(a) => registrar::run(a, &product::locate(cli.rserpool)?),
        BenchCommand::Proxy(a) => proxy::run(a, &product::locate(cli.rserpool)?),
        BenchCommand::LoadGen(a) => registrar::load_gen(a),
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
    format!("cargo run --release -p rserpool-bench -- {args}")
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

/// Raises the open-file limit as far as allowed (root: to `want`): a registrar benchmark with
/// tens of thousands of connections needs one descriptor each.
pub fn raise_nofile_limit(want: u64) -> u64 {
    use rlimit::Resource;
    let (soft, hard) = Resource::NOFILE.get().unwrap_or((1024, 1024));
    if soft >= want {
        return soft;
    }
    if hard < want && Resource::NOFILE.set(want, want).is_ok() {
        return want;
    }
    let _ = Resource::NOFILE.set(hard.min(want).max(soft), hard);
    Resource::NOFILE.get().map_or(soft, |(s, _)| s)
}
