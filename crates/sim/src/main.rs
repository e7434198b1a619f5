//! `rserpool-sim`: the simulation of every role (see the library's docs).
//!
//! `--seeds N [--from S] [--threads T]` runs N seeds and reports failures (each with the
//! command that replays it), the time taken and seeds per second; `--seed S` replays one seed
//! with its log (`RUST_LOG=debug` adds the cores' own).

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse::<u64>().ok())
    };
    if let Some(seed) = value("--seed") {
        if std::env::var_os("RUST_LOG").is_some() {
            tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
                .without_time()
                .with_writer(std::io::stderr)
                .init();
        }
        return match rserpool_sim::run_seed(seed, true) {
            Ok(o) => {
                println!(
                    "seed {seed}: ok, converged {} ms after healing",
                    o.converged_ms
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                println!("seed {seed} failed: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let Some(count) = value("--seeds") else {
        eprintln!("usage: rserpool-sim --seeds N [--from S] [--threads T] | --seed S");
        return ExitCode::FAILURE;
    };
    let threads = value("--threads").map_or_else(
        || std::thread::available_parallelism().map_or(1, |n| n.get()),
        |t| t as usize,
    );
    let summary = rserpool_sim::run_seeds(value("--from").unwrap_or(0), count, threads);
    print!("{}", summary.report(threads));
    if summary.failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
