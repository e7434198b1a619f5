//! `rserpool-bench`: the benchmarks of rserpool, a binary of their own so that the product
//! does not ship them. Each writes its results, with command and machine, into docs/:
//! `cargo run --release -p rserpool-bench -- handlespace|registrar|proxy|push|trace|levels …`, and the chaos soak
//! (`chaos`), whose summary goes into docs/RELIABILITY.md.

mod chaos;
mod handlespace;
mod ksplice;
mod levels;
mod net;
mod plot;
mod process;
mod procfs;
mod product;
mod proxy;
mod push;
mod registrar;
mod report;
mod session;
mod sidecar;
mod tier;
mod trace;
mod undo;
mod upgrade;
mod xds;

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
    /// The proxy side by side with HAProxy, nginx and direct (docs/BENCHMARKS.md).
    Proxy(proxy::ProxyBenchArgs),
    /// Credit reports to a subscribed pool user: the push path's latency (docs/CREDITS.md).
    Push(push::PushArgs),
    /// Selection schemes on a replayed Wikipedia-like trace: RR, WRR, LU, least connections,
    /// P2C, Prequal-style, DPR and DPR-Q credits, HAProxy leastconn and HAProxy with the
    /// agent-check (docs/CREDITS.md).
    Trace(trace::TraceArgs),
    /// Service levels: the seed's Figure 3 (two clients overloading a pool, client 1 at
    /// levels 1-9) beside HAProxy's priority classes and a FIFO queue (docs/LEVELS.md).
    Levels(levels::LevelsArgs),
    /// The kernel splice beside the user-space proxy, HAProxy and direct forwarding in
    /// network namespaces: bulk throughput and CPU per GiB, the seed's 100 concurrent PUTs,
    /// first-response latency (docs/KSPLICE.md). Needs root.
    Ksplice(ksplice::KspliceArgs),
    /// The ASAP session layer: failover time of a session after SIGKILL and SIGSTOP of its
    /// PE, and the cost of cookies (docs/SESSION.md).
    Session(session::SessionArgs),
    /// The fault-tolerant proxy tier in namespaces with every hop rate-limited: direct, one
    /// and two proxies, a proxy failure for each heartbeat interval, split splice (the TCP
    /// splice seed's Tables 2-7; docs/TIER.md). Needs root.
    Tier(tier::TierArgs),
    /// The registrar as an xDS control plane: time from a registration, credit change or
    /// death to an xDS client's view, and the registrar's CPU with many subscribers
    /// (docs/XDS.md).
    Xds(xds::XdsArgs),
    /// What an `rserpool serve` sidecar with policy credits costs, idle and at a rate of new
    /// connections to its target, per way of counting them (docs/PERFORMANCE.md). `ebpf`
    /// needs root.
    Sidecar(sidecar::SidecarArgs),
    /// Upgrading a proxy under load: rserpool's hand-over beside HAProxy's master-worker
    /// reload; refused connections, errors, p99 and maximum latency (docs/OPERATIONS.md).
    Upgrade(upgrade::UpgradeArgs),
    /// Chaos soak: registrars, PEs, a proxy and clients in network namespaces under random
    /// kills, link cuts and packet loss; checks that no PE is lost and no request fails.
    Chaos(chaos::ChaosArgs),
    /// Internal: a backend of `proxy`'s gRPC part.
    #[command(hide = true)]
    GrpcBackend(proxy::grpc_backend::GrpcBackendArgs),
    /// Internal: the bare HTTP/2 relay of `proxy`'s gRPC part (the system `h2-relay`).
    #[command(hide = true)]
    H2Relay(proxy::h2_relay::H2RelayArgs),
    /// Internal: the simulated PEs and PUs of `registrar`.
    #[command(hide = true)]
    LoadGen(registrar::LoadGenArgs),
}

/// The proxy's allocator, so that the bare HTTP/2 relay (`h2-relay`) costs what the same
/// crates cost in the proxy.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        BenchCommand::Handlespace(a) => handlespace::run(a),
        BenchCommand::Registrar(a) => registrar::run(a, &product::locate(cli.rserpool)?),
        BenchCommand::Proxy(a) => proxy::run(a, &product::locate(cli.rserpool)?),
        BenchCommand::Push(a) => push::run(a),
        BenchCommand::Xds(a) => xds::run(a, &product::locate(cli.rserpool)?),
        BenchCommand::Trace(a) => trace::run(a, &product::locate(cli.rserpool)?),
        BenchCommand::Levels(a) => levels::run(a, &product::locate(cli.rserpool)?),
        BenchCommand::Ksplice(a) => ksplice::run(a, &product::locate(cli.rserpool)?),
        BenchCommand::Tier(a) => tier::run(a, &product::locate(cli.rserpool)?),
        BenchCommand::Session(a) => session::run(a, &product::locate(cli.rserpool)?),
        BenchCommand::Sidecar(a) => sidecar::run(a, &product::locate(cli.rserpool)?),
        BenchCommand::Upgrade(a) => upgrade::run(a, &product::locate(cli.rserpool)?),
        BenchCommand::Chaos(a) => chaos::run(a, &product::locate(cli.rserpool)?),
        BenchCommand::LoadGen(a) => registrar::load_gen(a),
        BenchCommand::GrpcBackend(a) => proxy::grpc_backend::run(a),
        BenchCommand::H2Relay(a) => proxy::h2_relay::run(a),
    }
}
