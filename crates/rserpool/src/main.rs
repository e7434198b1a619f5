//! `rserpool`: one binary for every role of a Reliable Server Pooling system. Subcommands arrive
//! with the roadmap; today: `up` (the built-in example) and `bench`.

mod bench;

use anyhow::{Result, bail};
use clap::{Parser, Subcommand};
use rserpool_handlespace::{Config, Handlespace};
use rserpool_wire::policy::{load_from_fraction, load_to_fraction};
use rserpool_wire::{
    AsapMessage, Policy, PoolElement, PoolHandle, Protocol, TransportAddress, UserTransport,
};
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "rserpool",
    version,
    about = "Reliable Server Pooling (RFC 5351-5356)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the built-in example: the EchoPool handlespace with three least-used PEs.
    Up,
    /// Benchmarks (results go to docs/BENCHMARKS.md by hand, with the machine line printed).
    Bench {
        #[command(subcommand)]
        what: BenchCommand,
    },
}

#[derive(Subcommand)]
enum BenchCommand {
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
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Up => up(),
        Command::Bench {
            what:
                BenchCommand::Handlespace {
                    pes,
                    json,
                    round_ms,
                    markdown,
                    memory_probe,
                },
        } => {
            if let Some(n) = memory_probe {
                println!("{}", bench::handlespace::memory_probe(n.max(1))?);
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
                println!("machine: {}", bench::handlespace::machine());
            }
            let mut results = Vec::new();
            for n in sizes {
                let r = bench::handlespace::run_size(n, Duration::from_millis(round_ms.max(10)))?;
                if json {
                    println!("{}", serde_json::to_string(&r)?);
                } else {
                    bench::handlespace::print_table(&r);
                }
                results.push(r);
            }
            if let Some(path) = markdown {
                let command = std::env::args().skip(1).collect::<Vec<_>>().join(" ");
                let section =
                    bench::handlespace::markdown(&results, &format!("rserpool {command}"));
                bench::handlespace::write_markdown(&path, &section)?;
            }
            Ok(())
        }
    }
}

/// The built-in example. Until the registrar arrives (roadmap step 2) it runs the real
/// handlespace and codec in-process: registers the EchoPool, resolves it by least used, and
/// shows the ASAP bytes a registrar would answer with.
fn up() -> Result<()> {
    let mut hs = Handlespace::new(Config::default());
    let pool = PoolHandle::from("EchoPool");
    let own_id = 0x5250_0001;
    for (i, load) in [(1u32, 0.10), (2, 0.50), (3, 0.30)] {
        let element = PoolElement {
            id: i,
            home_registrar: own_id,
            registration_life: -1,
            user_transport: UserTransport::Address(TransportAddress {
                protocol: Protocol::TCP,
                port: 7000 + i as u16,
                addresses: vec![IpAddr::V4(Ipv4Addr::LOCALHOST)].into(),
            }),
            policy: Policy::LeastUsed {
                load: load_from_fraction(load),
            },
            asap_transport: None,
        };
        hs.register(&pool, element, 0)?;
    }
    println!(
        "rserpool {} — EchoPool with three least-used PEs",
        env!("CARGO_PKG_VERSION")
    );
    let request = AsapMessage::HandleResolution {
        subscribe: false,
        pool_handle: pool.clone(),
        items: Some(3),
    };
    println!("HANDLE_RESOLUTION   {}", hexdump(&request.to_bytes()?));
    for round in 1..=3 {
        let mut refs = Vec::new();
        hs.resolve(pool.as_bytes(), 3, &mut refs);
        let pes: Vec<PoolElement> = refs.iter().map(|&r| hs.pe(r).element.clone()).collect();
        let order: Vec<String> = pes
            .iter()
            .map(|pe| {
                let load = pe.policy.load().map_or(0.0, load_to_fraction);
                format!("PE {} ({:.0}% load)", pe.id, load * 100.0)
            })
            .collect();
        println!("resolution {round}: {}", order.join(", "));
        if round == 1 {
            let response = AsapMessage::HandleResolutionResponse {
                accept: false,
                pool_handle: pool.clone(),
                policy: pes.first().map(|p| p.policy.clone()),
                pool_elements: pes,
                error: None,
            };
            println!(
                "HANDLE_RESOLUTION_RESPONSE {}",
                hexdump(&response.to_bytes()?)
            );
        }
    }
    println!(
        "ownership checksum of registrar {own_id:#010x}: {:#06x}",
        hs.checksum(own_id)
    );
    println!(
        "The networked registrar, pool elements and proxy arrive with the next roadmap steps."
    );
    Ok(())
}

fn hexdump(b: &[u8]) -> String {
    b.iter()
        .map(|x| format!("{x:02x}"))
        .collect::<Vec<_>>()
        .join(" ")
}
