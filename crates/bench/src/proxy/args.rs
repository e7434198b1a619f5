//! The proxy benchmark's command line: which systems, which parts, how long and how hard.

use clap::{Args, ValueEnum};
use serde::Serialize;
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum System {
    Direct,
    Rserpool,
    Haproxy,
    Nginx,
    /// A bare relay of HTTP/2 streams on the proxy's crates, for the gRPC part only
    /// (`h2_relay`): what those crates cost per call.
    H2Relay,
    /// rserpool's proxy from another binary (`--baseline`, the build before a change),
    /// alternating with `rserpool` in every round: a change's effect beside this machine's
    /// drift.
    Baseline,
}

impl System {
    pub(super) fn label(self) -> &'static str {
        match self {
            System::Direct => "direct",
            System::Rserpool => "rserpool",
            System::Haproxy => "HAProxy",
            System::Nginx => "nginx",
            System::H2Relay => "bare h2 relay",
            System::Baseline => "baseline",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Part {
    /// HTTP/1.1 keep-alive, small response (wrk): requests/s, p50, p99.
    Keepalive,
    /// A new connection per request (wrk, Connection: close): connections/s.
    Connect,
    /// TCP mode bulk download: MB/s.
    Bulk,
    /// The seed's experiment: concurrent uploads (PUT) and downloads (GET) of large files.
    Transfer,
    /// A backend killed with SIGKILL under load.
    Failover,
    /// HTTPS terminated by the proxy (ECDSA P-256), keep-alive (wrk): requests/s.
    HttpsKeepalive,
    /// HTTPS, a new connection (and TLS handshake) per request: connections/s.
    HttpsConnect,
    /// HTTP/2 in cleartext (prior knowledge) to HTTP/1.1 backends (h2load, `--streams` per
    /// connection): requests/s, p50, p99.
    H2,
    /// HTTP/2 over TLS (ALPN) to HTTP/1.1 backends (h2load): requests/s, p50, p99.
    H2Tls,
    /// gRPC-shaped unary calls (HTTP/2 both ways, trailers) to HTTP/2 backends (h2load):
    /// calls/s, p50, p99.
    Grpc,
    /// Idle kept-alive HTTP/1.1 connections (`--idle-connections`, one request each): the
    /// system's resident memory per connection.
    Idle,
    /// The same over HTTP/2 (prior knowledge), in a system started afresh.
    IdleH2,
    /// The same over HTTPS (HTTP/1.1 by ALPN), in a system started afresh.
    IdleTls,
    /// HTTP/2 streams in flight (`--held-connections` × `--held-streams` gRPC-shaped calls the
    /// backends never answer, HTTP/2 both ways): the system's resident memory per stream.
    H2Streams,
}

impl Part {
    /// Parts that h2load drives.
    pub(super) fn is_h2(self) -> bool {
        matches!(self, Part::H2 | Part::H2Tls | Part::Grpc)
    }

    /// Parts that measure memory, not throughput.
    pub(super) fn is_memory(self) -> bool {
        matches!(
            self,
            Part::Idle | Part::IdleH2 | Part::IdleTls | Part::H2Streams
        )
    }
}

#[derive(Args, Debug)]
pub struct ProxyBenchArgs {
    /// Worker threads of every proxy (rserpool --threads, HAProxy nbthread, nginx
    /// worker_processes) and of the load generators.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Concurrent connections of wrk and h2load.
    #[arg(long, default_value_t = 50)]
    pub connections: usize,
    /// Concurrent streams per HTTP/2 connection (h2load -m).
    #[arg(long, default_value_t = 10)]
    pub streams: usize,
    /// Length of each wrk run and of the bulk run, seconds.
    #[arg(long, default_value_t = 5)]
    pub duration_s: u64,
    /// Rounds; the systems alternate within a round and the report gives medians.
    #[arg(long, default_value_t = 1)]
    pub repeat: usize,
    /// Idle connections of the idle part, of each protocol. HAProxy takes two descriptors
    /// per connection and refuses to start unless the open-file limit holds its `maxconn`
    /// (9,900 here, for a limit of 20,000), so more than that needs a higher limit.
    #[arg(long, default_value_t = 8_000)]
    pub idle_connections: usize,
    /// HTTP/2 connections of the streams part (each makes one call first).
    #[arg(long, default_value_t = 100)]
    pub held_connections: usize,
    /// Streams held open on each of them (every system takes at least 100 at once).
    #[arg(long, default_value_t = 50)]
    pub held_streams: usize,
    /// Concurrent transfers of the seed's experiment.
    #[arg(long, default_value_t = 100)]
    pub transfers: usize,
    /// Transfer sizes in MiB (repeatable); default 10 and 20.
    #[arg(long = "transfer-mb")]
    pub transfer_mb: Vec<usize>,
    /// Concurrent connections of the TCP bulk run.
    #[arg(long, default_value_t = 4)]
    pub bulk_connections: usize,
    /// Also run TCP bulk with every hop limited to this rate (Mbit/s, by `tc` on loopback, as
    /// on the seed paper's testbed network); 0 skips it.
    #[arg(long, default_value_t = 1000)]
    pub link_mbit: u64,
    /// Keep-alive clients of the failover run.
    #[arg(long, default_value_t = 8)]
    pub failover_clients: usize,
    /// How long the failover run watches after the kill, ms (HAProxy's default checks need
    /// about 6 s to take a server out).
    #[arg(long, default_value_t = 8000)]
    pub failover_ms: u64,
    /// The rserpool binary of the system `baseline` (e.g. a copy of `target/release/rserpool`
    /// built before a change).
    #[arg(long, value_name = "PATH")]
    pub baseline: Option<PathBuf>,
    /// Systems to measure.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "direct,rserpool,haproxy,nginx"
    )]
    pub systems: Vec<System>,
    /// Parts to run.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "keepalive,connect,https-keepalive,https-connect,bulk,transfer,failover"
    )]
    pub parts: Vec<Part>,
    /// Also count each proxy's system calls per request (`perf stat` on the
    /// `raw_syscalls:sys_enter` tracepoint; needs perf and root).
    #[arg(long)]
    pub syscalls: bool,
    /// One JSON object per system and round on stdout.
    #[arg(long)]
    pub json: bool,
    /// Write the results as a Markdown section into this file (e.g. docs/BENCHMARKS.md).
    #[arg(long, value_name = "FILE")]
    pub markdown: Option<PathBuf>,
    /// The name of that section (runs of different parts can go to different sections).
    #[arg(long, default_value = "proxy")]
    pub section: String,
    /// Write PNG bar charts with this path prefix (e.g. docs/bench-proxy).
    #[arg(long, value_name = "PREFIX")]
    pub plot: Option<String>,
}
