//! `rserpool`: one binary for every role of a Reliable Server Pooling system: the registrar,
//! a sidecar that makes an existing TCP service a pool element, example pool elements, pool user
//! tools (`resolve`, `connect`), `status` and the all-in-one `up`. The benchmarks are a separate
//! binary: crates/bench.

mod cmd;

use anyhow::Result;
use clap::{Args, CommandFactory, Parser, Subcommand};
use std::net::SocketAddr;

#[derive(Parser)]
#[command(
    name = "rserpool",
    version,
    about = "Reliable Server Pooling (RFC 5351-5356): registrar, pool elements, pool users"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Print the command's effective settings as TOML (a config file's for `registrar` and
    /// `proxy`, the options with their defaults for the others) and exit.
    #[arg(long, global = true)]
    print_config: bool,
    /// Log lines as text, or as JSON objects (one per line, for a log collector).
    #[arg(
        long,
        global = true,
        value_enum,
        default_value = "text",
        env = "RSERPOOL_LOG_FORMAT"
    )]
    log_format: cmd::LogFormat,
}

/// Where to find registrars (pool element and pool user commands).
#[derive(Args, Debug, Clone, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct RegistrarOpts {
    /// Registrar ASAP address (repeatable; tried in order, then announced ones): TCP, or
    /// SCTP with `sctp+udp://ADDR` (SCTP over UDP 9899) or `sctp://ADDR` (raw IP, root).
    #[arg(
        long = "registrar",
        value_name = "ADDR",
        default_value = "127.0.0.1:3863"
    )]
    pub registrars: Vec<rserpool_wire::Address>,
    /// Also learn registrars from SERVER_ANNOUNCE received on this UDP address
    /// (e.g. 0.0.0.0:3863, or 239.0.0.1:3863 to join the multicast group).
    #[arg(long, value_name = "ADDR")]
    pub announce_listen: Option<SocketAddr>,
    /// TLS with the registrars (RFC 5355): this process's certificate, PEM (with --tls-key and
    /// --tls-ca; `rserpool cert` makes some to try).
    #[arg(long, value_name = "FILE", requires_all = ["tls_key", "tls_ca"])]
    pub tls_cert: Option<std::path::PathBuf>,
    /// TLS: the private key of --tls-cert, PEM.
    #[arg(long, value_name = "FILE", requires_all = ["tls_cert", "tls_ca"])]
    pub tls_key: Option<std::path::PathBuf>,
    /// TLS: the CA certificate the registrars' certificates chain to, PEM.
    #[arg(long, value_name = "FILE", requires_all = ["tls_cert", "tls_key"])]
    pub tls_ca: Option<std::path::PathBuf>,
}

impl RegistrarOpts {
    /// The TLS identity given, loaded.
    pub fn tls(&self) -> Result<Option<std::sync::Arc<rserpool_tls::Tls>>> {
        let (Some(cert), Some(key), Some(ca)) = (&self.tls_cert, &self.tls_key, &self.tls_ca)
        else {
            return Ok(None);
        };
        let files = rserpool_tls::TlsFiles {
            cert: cert.clone(),
            key: key.clone(),
            ca: ca.clone(),
        };
        Ok(Some(std::sync::Arc::new(rserpool_tls::Tls::load(&files)?)))
    }
}

/// A pool element's registration settings.
#[derive(Args, Debug, Clone, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct PeOpts {
    /// Pool handle to register in.
    #[arg(long)]
    pub pool: String,
    /// Pool policy: rr, wrr, rand, wrand, prio, lu, lud, plu, rlu, or credits (pushed by the
    /// PE from its accept queue and work in flight; `example` and `serve`, see --capacity).
    #[arg(long, default_value = "rr")]
    pub policy: String,
    /// Weight (wrr, wrand) or priority (prio).
    #[arg(long, default_value_t = 1)]
    pub weight: u32,
    /// PE identifier (default: random).
    #[arg(long, value_parser = cmd::parse_u32)]
    pub id: Option<u32>,
    /// Re-registration interval; the registration life sent is three times it.
    #[arg(long, default_value_t = 30_000)]
    pub reregistration_interval_ms: u64,
    #[command(flatten)]
    pub registrars: RegistrarOpts,
    /// Send rsplib's Component Status reports to this monitor (its `cspmonitor` listens on UDP
    /// 2960): the PE's identifier, registration and load. rsplib's `CSP_SERVER` works too.
    #[arg(long, env = "CSP_SERVER", value_parser = cmd::parse_csp_monitor)]
    pub csp: Option<SocketAddr>,
    /// Interval of the component status reports (rsplib's `CSP_INTERVAL`).
    #[arg(long, env = "CSP_INTERVAL", default_value_t = 1000)]
    pub csp_interval_ms: u64,
}

/// How a PE with policy `credits` reports them (docs/CREDITS.md).
#[derive(Args, Debug, Clone, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct CreditOpts {
    /// Reporting algorithm: dpr (every change) or dpr-q (only across a quantum of an eighth of
    /// the capacity, or at 0 and full).
    #[arg(long, default_value = "dpr-q")]
    pub credit_reporting: String,
    /// How often the accept queue and the work in flight are sampled.
    #[arg(long, default_value_t = 5)]
    pub credit_sample_ms: u64,
    /// At most one credit report (a re-registration) per this interval.
    #[arg(long, default_value_t = 5)]
    pub credit_min_interval_ms: u64,
}

#[derive(Subcommand)]
enum Command {
    /// Run everything on loopback: a registrar, the EchoPool (echo PEs, least used) and the
    /// WebPool (HTTP PEs), and a proxy in front of both.
    Up(cmd::up::UpArgs),
    /// Run a registrar (ASAP and ENRP over TCP, and over SCTP where an address says so).
    Registrar(Box<cmd::registrar::RegistrarArgs>),
    /// Register an existing TCP service as a pool element and keep it registered while healthy.
    Serve(cmd::serve::ServeArgs),
    /// Run a small example service (echo, discard, daytime, chargen, http, calc) as a pool
    /// element.
    Example(cmd::example::ExampleArgs),
    /// Resolve a pool handle at a registrar.
    Resolve(cmd::client::ResolveArgs),
    /// Connect to a pool element of a pool and relay stdin/stdout (fails over to the next PE).
    Connect(cmd::client::ConnectArgs),
    /// Run a job on a calculator pool (`example calc`) in a session that survives the failure
    /// of its pool element (the ASAP session layer); prints each failover and where it resumed.
    Session(cmd::calc::SessionArgs),
    /// Front-end proxy: TCP or HTTP load balancing onto pools, with failover.
    Proxy(Box<cmd::proxy::ProxyArgs>),
    /// The front of a proxy tier: keeps a resilient nexthop group of the router equal to the
    /// live proxies of the tier pool (heartbeats, workload weights; docs/TIER.md). Needs root
    /// and iproute2.
    Distributor(cmd::distributor::DistributorArgs),
    /// A server of a proxy tier's pool that answers the clients of its spliced connections
    /// directly (split splice; docs/TIER.md). Needs root.
    SplitSplice(cmd::split::SplitArgs),
    /// Show a registrar's handlespace.
    Status(cmd::client::StatusArgs),
    /// Check a registrar's or a proxy's config file: every error, with its line.
    CheckConfig(cmd::check::CheckArgs),
    /// Make a test CA and certificates (ECDSA P-256) for trying TLS between registrars, pool
    /// elements, pool users and the proxy.
    Cert(cmd::cert::CertArgs),
    /// A hostile peer for testing the defences of docs/SECURITY.md: sends one of RFC 5355's
    /// attacks (a forged takeover, false unreachable reports) at your own deployment.
    Attack(cmd::attack::AttackArgs),
    /// Take a pool element out of its pool gracefully: it deregisters and serves what still
    /// reaches it (its control socket, `example --control PATH`).
    Drain(cmd::control::DrainArgs),
    /// Put a drained pool element back into its pool.
    Undrain(cmd::control::DrainArgs),
    /// Print the shell completion script for bash, zsh, fish, elvish or PowerShell
    /// (e.g. `rserpool completions bash > /etc/bash_completion.d/rserpool`).
    Completions(cmd::manual::CompletionsArgs),
    /// Write the man pages (rserpool.1 and one per command) into a directory.
    Man(cmd::manual::ManArgs),
}

/// mimalloc: the proxy allocates per request (heads, header maps, HTTP/2 frames and tasks);
/// glibc's allocator took a tenth of its CPU under load.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// No transparent huge pages for the proxy's process (and the ones it starts), before its
/// memory grows. mimalloc asks for them on its arenas (`madvise`), and then a 2 MiB page is
/// resident as soon as any of it is touched: an idle HTTP/2 connection cost the proxy 38.4 KiB
/// with them and 29.3 without, a held HTTP/2 stream 7.4 and 5.6, at the same CPU per request.
/// The registrar keeps them: at 100,000 PEs it took about a tenth more CPU without them (more
/// TLB misses over a large handlespace), and its memory is not per connection
/// (docs/PERFORMANCE.md). mimalloc's own switch, `MIMALLOC_ALLOW_THP`, set in the environment,
/// decides instead.
fn no_huge_pages() {
    if std::env::var_os("MIMALLOC_ALLOW_THP").is_none() {
        // Refused only by kernels without the call; nothing to do then.
        let _ = rustix::thread::disable_transparent_huge_pages(true);
    }
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    if matches!(cli.command, Command::Proxy(_) | Command::Up(_)) {
        no_huge_pages();
    }
    rserpool_tls::install_provider();
    cmd::set_log_format(cli.log_format);
    if cli.print_config {
        return print_config(&cli.command);
    }
    match cli.command {
        Command::Up(a) => cmd::up::run(a),
        Command::Registrar(a) => cmd::registrar::run(*a),
        Command::Serve(a) => cmd::serve::run(a),
        Command::Example(a) => cmd::example::run(a),
        Command::Resolve(a) => cmd::client::resolve(a),
        Command::Connect(a) => cmd::client::connect(a),
        Command::Session(a) => cmd::calc::run_session(a),
        Command::Status(a) => cmd::client::status(a),
        Command::Proxy(a) => cmd::proxy::run(*a),
        Command::Distributor(a) => cmd::distributor::run(a),
        Command::SplitSplice(a) => cmd::split::run(a),
        Command::CheckConfig(a) => cmd::check::run(a),
        Command::Cert(a) => cmd::cert::run(a),
        Command::Attack(a) => cmd::attack::run(a),
        Command::Drain(a) => cmd::control::run(a, true),
        Command::Undrain(a) => cmd::control::run(a, false),
        Command::Completions(a) => cmd::manual::completions(a, Cli::command()),
        Command::Man(a) => cmd::manual::man_pages(a, Cli::command()),
    }
}

/// `--print-config`: what the command would run with.
fn print_config(command: &Command) -> Result<()> {
    let text = match command {
        Command::Registrar(a) => toml::to_string(&cmd::registrar::load_config(a)?)?,
        Command::Proxy(a) => toml::to_string(&cmd::proxy::load(a)?)?,
        Command::Up(a) => toml::to_string(a)?,
        Command::Serve(a) => toml::to_string(a)?,
        Command::Example(a) => toml::to_string(a)?,
        Command::Resolve(a) => toml::to_string(a)?,
        Command::Connect(a) => toml::to_string(a)?,
        Command::Session(a) => toml::to_string(a)?,
        Command::Status(a) => toml::to_string(a)?,
        Command::Distributor(a) => toml::to_string(a)?,
        Command::SplitSplice(a) => toml::to_string(a)?,
        Command::CheckConfig(a) => toml::to_string(a)?,
        Command::Cert(a) => toml::to_string(a)?,
        Command::Attack(a) => toml::to_string(a)?,
        Command::Drain(a) | Command::Undrain(a) => toml::to_string(a)?,
        Command::Completions(a) => toml::to_string(a)?,
        Command::Man(a) => toml::to_string(a)?,
    };
    print!("{text}");
    Ok(())
}
