//! `rserpool-bench trace`'s flags.

use super::scheme::SCHEMES;
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct TraceArgs {
    /// Schemes to compare (comma-separated), of: rr, wrr, lu, least-connections, p2c, prequal,
    /// maglev, ring-hash, dpr, dpr-q, haproxy-rr, haproxy-wrr, haproxy-leastconn,
    /// haproxy-agent.
    #[arg(long, value_delimiter = ',', default_value = SCHEMES)]
    pub schemes: Vec<String>,
    /// Scale factors of the trace (fractions of its requests replayed).
    #[arg(long, value_delimiter = ',', default_value = "1/32,1/16,1/8")]
    pub factors: Vec<String>,
    /// Seconds of trace replayed per factor and scheme.
    #[arg(long, default_value_t = 30)]
    pub duration_s: u64,
    /// Workers of each back end: their capacities.
    #[arg(long, value_delimiter = ',', default_value = "2,4,8")]
    pub workers: Vec<usize>,
    /// Accept queue of each back end.
    #[arg(long, default_value_t = 64)]
    pub backlog: u32,
    /// Share of the pool's capacity the largest factor offers (costs are scaled to it).
    #[arg(long, default_value_t = 0.9)]
    pub utilisation: f64,
    /// Replay this wikibench trace file instead of a synthetic one.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Synthetic trace: mean requests/s at factor 1 (2,640 makes the seed's 82.6 / 165 /
    /// 330 requests/s at 1/32, 1/16, 1/8).
    #[arg(long, default_value_t = 2640.0)]
    pub rate: f64,
    /// Synthetic trace: burst amplitudes (the rate alternates between 1 ± this times the
    /// mean); every scheme runs at each.
    #[arg(long, alias = "burst", value_delimiter = ',', default_value = "0.25")]
    pub bursts: Vec<f64>,
    /// Synthetic trace: seeds; every scheme runs with each.
    #[arg(long, alias = "seed", value_delimiter = ',', default_value = "1")]
    pub seeds: Vec<u64>,
    /// A request not answered in full within this is an error.
    #[arg(long, default_value_t = 10)]
    pub timeout_s: u64,
    /// Write the results as a Markdown section into this file (e.g. docs/CREDITS.md).
    #[arg(long)]
    pub markdown: Option<PathBuf>,
    /// The generated section of `--markdown` the results replace.
    #[arg(long, default_value = "trace")]
    pub section: String,
    /// Write the plots (PNG) into this directory (e.g. docs); of the first seed and burst.
    #[arg(long)]
    pub plots: Option<PathBuf>,
}
