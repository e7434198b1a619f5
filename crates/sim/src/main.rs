//! `rserpool-sim`: the simulation of every role (see the library's docs).
//!
//! `--seeds N [--from S] [--threads T]` runs N seeds and reports failures (each with the
//! command that replays it), the time taken and seeds per second; `--seed S` replays one seed
//! with its log (`RUST_LOG=debug` adds the cores' own). With `--tier`, the same for the proxy
//! tier's simulation (`rserpool_sim::tier`).

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse::<u64>().ok())
    };
    let tier = args.iter().any(|a| a == "--tier");
    if let Some(seed) = value("--seed") {
        if std::env::var_os("RUST_LOG").is_some() {
            tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
                .without_time()
                .with_writer(std::io::stderr)
                .init();
        }
        if tier {
            return match rserpool_sim::tier::run_seed(seed, true) {
                Ok(_) => {
                    println!("tier seed {seed}: ok");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    println!("tier seed {seed} failed: {e}");
                    ExitCode::FAILURE
                }
            };
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
        eprintln!(
            "usage: rserpool-sim [--tier] --seeds N [--from S] [--threads T] | [--tier] --seed S"
        );
        return ExitCode::FAILURE;
    };
    let threads = value("--threads").map_or_else(
        || std::thread::available_parallelism().map_or(1, |n| n.get()),
        |t| t as usize,
    );
    let from = value("--from").unwrap_or(0);
    let failed = if tier {
        let summary =
            rserpool_sim::tier::run_seeds(from, count, threads, rserpool_sim::tier::Break::None);
        print!("{}", summary.report(threads));
        !summary.failures.is_empty()
    } else {
        let summary = rserpool_sim::run_seeds(from, count, threads);
        print!("{}", summary.report(threads));
        !summary.failures.is_empty()
    };
    if !failed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
