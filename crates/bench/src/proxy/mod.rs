//! `rserpool-bench proxy`: the rserpool proxy side by side with HAProxy and nginx, and with
//! the client talking to the backends directly (the physical baseline), in one run on one
//! machine — the comparison users make before switching (docs/BENCHMARKS.md).
//!
//! The same three nginx backends serve every system: a small static file, large files, and
//! WebDAV PUT into tmpfs. Each backend is a pool element through an `rserpool serve` sidecar.
//! The same load generators drive every system with the same threads: `wrk` for requests/s
//! and connections/s, and rserpool's own HTTP client (`rserpool_proxy::http::client`) for TCP bulk
//! throughput, the seed paper's 100 concurrent uploads and downloads, and the failover run.
//!
//! Failover is measured from outside every proxy: a raw socket with a BPF filter timestamps
//! each connection attempt (SYN) to the killed backend, so "traffic off the dead PE" means no
//! proxy connects to it any more, whatever the proxy's own counters say. The sidecar checks
//! the backend on a second address so that its checks are not counted.
//!
//! Memory per idle kept-alive connection (`idle.rs`) is the resident memory of all of a
//! system's processes before and after thousands of connections that made one request each;
//! memory per HTTP/2 stream in flight (`streams.rs`) the same before and after thousands of calls
//! the backends never answer.

mod args;
pub(crate) mod bed;
mod config;
mod cost;
mod failover;
mod front;
pub mod grpc_backend;
pub mod h2_relay;
mod h2load;
mod idle;
mod load;
mod report;
mod shaping;
mod streams;
mod synwatch;
mod tools;
pub(crate) mod wrk;

pub use args::ProxyBenchArgs;

use crate::procfs::{machine_busy_since, machine_cpu_ticks};
use crate::report::{machine, write_section};
use crate::undo;
use anyhow::{Context, Result, bail};
use args::{Part, System};
use bed::Bed;
use failover::Failover;
use load::Transfer;
use serde::Serialize;
use std::path::Path;
use std::time::Duration;
use wrk::Wrk;

pub(crate) const POOL: &str = "BenchPool";
/// The gRPC part's pool: HTTP/2 backends.
const GRPC_POOL: &str = "GrpcPool";
/// The gRPC part's call: a 5-byte message in gRPC's framing.
const GRPC_PATH: &str = "/bench.Echo/Echo";
const GRPC_MESSAGE: &[u8] = b"\0\0\0\0\x05hello";
/// A method the gRPC backends never answer: the streams part holds its calls.
const HOLD_PATH: &str = "/bench.Echo/Hold";
const BACKENDS: usize = 3;
pub(crate) const SMALL: &str = "/small.html";
const SMALL_SIZE: usize = 612; // nginx's welcome page
const BULK: &str = "/bulk";
const BULK_SIZE: usize = 256 << 20;
const MB: usize = 1 << 20;

/// One system's figures in one round.
#[derive(Serialize, Clone, Debug)]
struct Sample {
    system: System,
    round: usize,
    keepalive: Option<Wrk>,
    connect: Option<Wrk>,
    https_keepalive: Option<Wrk>,
    https_connect: Option<Wrk>,
    h2: Option<Wrk>,
    h2_tls: Option<Wrk>,
    grpc: Option<Wrk>,
    bulk_mib_s: Option<f64>,
    /// The share of the machine's CPU (all cores) that was busy during the loopback bulk run.
    bulk_busy: Option<f64>,
    /// The same over rate-limited hops (`--link-mbit`).
    bulk_link_mib_s: Option<f64>,
    transfers: Vec<Transfer>,
    failover: Option<Failover>,
    idle: Option<idle::Idle>,
}

pub fn run(args: ProxyBenchArgs, rserpool: &Path) -> Result<()> {
    if args.threads == 0 || args.connections == 0 || args.repeat == 0 || args.duration_s == 0 {
        bail!("--threads, --connections, --repeat and --duration-s must be at least 1");
    }
    tools::check(&args)?;
    if args.syscalls {
        cost::check_syscalls()?;
    }
    undo::on_signal()?;
    let sizes = if args.transfer_mb.is_empty() {
        vec![10, 20]
    } else {
        args.transfer_mb.clone()
    };
    let versions = tools::versions();
    if !args.json {
        println!("machine: {}", machine());
        println!("{versions}");
    }
    let grpc = args
        .parts
        .iter()
        .any(|p| matches!(p, Part::Grpc | Part::H2Streams));
    if args.systems.contains(&System::Baseline) && args.baseline.is_none() {
        bail!("the system baseline needs --baseline PATH (the rserpool binary to compare with)");
    }
    let mut bed = Bed::start(&sizes, rserpool, grpc)?;
    bed.baseline.clone_from(&args.baseline);
    let mut samples = Vec::new();
    // Parts outside, systems inside: the systems meet one part back to back, under the same
    // conditions (large transfers leave the machine slower for a while).
    for round in 0..args.repeat {
        let mut round_samples: Vec<Sample> = args
            .systems
            .iter()
            .map(|&system| Sample::new(system, round))
            .collect();
        // The systems' order is reversed every other round: one measured first in every round
        // met a different machine (a part's first run after the one before) each time.
        let mut order: Vec<usize> = (0..round_samples.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for &part in &args.parts {
            for &i in &order {
                let rs = &mut round_samples[i];
                let mut s = Sample::new(rs.system, round);
                measure(&mut bed, &mut s, part, &sizes, &args)
                    .with_context(|| format!("measuring {}", rs.system.label()))?;
                if !args.json {
                    report::print_sample(&s);
                }
                rs.merge(s);
            }
        }
        for s in round_samples {
            if args.json {
                println!("{}", serde_json::to_string(&s)?);
            }
            samples.push(s);
        }
    }
    let report = report::Report::new(&args, &samples, &sizes);
    if let Some(path) = &args.markdown {
        write_section(path, &args.section, &report.markdown(&args, &versions))?;
    }
    if let Some(prefix) = &args.plot {
        report.plot(prefix)?;
    }
    Ok(())
}

impl Sample {
    fn new(system: System, round: usize) -> Sample {
        Sample {
            system,
            round,
            keepalive: None,
            connect: None,
            https_keepalive: None,
            https_connect: None,
            h2: None,
            h2_tls: None,
            grpc: None,
            bulk_mib_s: None,
            bulk_busy: None,
            bulk_link_mib_s: None,
            transfers: Vec::new(),
            failover: None,
            idle: None,
        }
    }

    fn merge(&mut self, o: Sample) {
        self.keepalive = self.keepalive.or(o.keepalive);
        self.connect = self.connect.or(o.connect);
        self.https_keepalive = self.https_keepalive.or(o.https_keepalive);
        self.https_connect = self.https_connect.or(o.https_connect);
        self.h2 = self.h2.or(o.h2);
        self.h2_tls = self.h2_tls.or(o.h2_tls);
        self.grpc = self.grpc.or(o.grpc);
        self.bulk_mib_s = self.bulk_mib_s.or(o.bulk_mib_s);
        self.bulk_busy = self.bulk_busy.or(o.bulk_busy);
        self.bulk_link_mib_s = self.bulk_link_mib_s.or(o.bulk_link_mib_s);
        self.transfers.extend(o.transfers);
        self.failover = self.failover.take().or(o.failover);
        self.idle = match (self.idle, o.idle) {
            (Some(a), Some(b)) => Some(a.merge(b)),
            (a, b) => a.or(b),
        };
    }
}

/// One part against one system, started afresh for it.
fn measure(
    bed: &mut Bed,
    s: &mut Sample,
    part: Part,
    sizes: &[usize],
    args: &ProxyBenchArgs,
) -> Result<()> {
    let https = matches!(part, Part::HttpsKeepalive | Part::HttpsConnect);
    let needs_proxy = part == Part::Failover || part.is_memory() || https || part.is_h2();
    if needs_proxy && s.system == System::Direct {
        return Ok(());
    }
    if s.system == System::H2Relay && part != Part::Grpc {
        return Ok(()); // It relays HTTP/2 to HTTP/2 only.
    }
    let front = front::start(bed, s.system, args.threads)?;
    // (None for the bare h2 relay, which serves the gRPC part only.)
    let url = front
        .http
        .first()
        .map(|a| format!("http://{a}{SMALL}"))
        .unwrap_or_default();
    let rt = load::client_runtime(args.threads)?;
    match part {
        Part::Keepalive => s.keepalive = Some(wrk::run(&url, args, false, &front)?),
        Part::Connect => s.connect = Some(wrk::run(&url, args, true, &front)?),
        Part::HttpsKeepalive | Part::HttpsConnect => {
            let Some(addr) = front.https else {
                return Ok(());
            };
            let url = format!("https://{addr}{SMALL}");
            let close = part == Part::HttpsConnect;
            let w = Some(wrk::run(&url, args, close, &front)?);
            if close {
                s.https_connect = w;
            } else {
                s.https_keepalive = w;
            }
        }
        Part::Bulk => {
            let run = || {
                rt.block_on(load::bulk(
                    front.tcp.clone(),
                    args.bulk_connections,
                    Duration::from_secs(args.duration_s),
                ))
            };
            let ticks = machine_cpu_ticks();
            s.bulk_mib_s = Some(run()?);
            s.bulk_busy = machine_busy_since(ticks);
            if args.link_mbit > 0 {
                let _links = shaping::Links::limit(args.link_mbit, &bed.backends, &front.tcp)?;
                s.bulk_link_mib_s = Some(run()?);
            }
        }
        Part::Transfer => {
            for &mib in sizes {
                for method in ["PUT", "GET"] {
                    s.transfers.push(rt.block_on(load::transfer(
                        front.http.clone(),
                        method,
                        mib,
                        args.transfers,
                    ))?);
                    // Free the uploads' tmpfs pages and let the machine settle.
                    bed.clear_uploads()?;
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
        }
        Part::Failover => s.failover = Some(failover::run(bed, &front, &rt, args)?),
        Part::Idle | Part::IdleH2 | Part::IdleTls => {
            let kind = match part {
                Part::IdleH2 => idle::Kind::H2,
                Part::IdleTls => idle::Kind::Tls(&bed.tls.ca),
                _ => idle::Kind::H1,
            };
            let i = idle::run(&front, &rt, args.idle_connections, s.system.label(), kind)?;
            s.idle = Some(s.idle.map_or(i, |o| o.merge(i)));
        }
        Part::H2Streams => {
            let (c, k) = (args.held_connections, args.held_streams);
            if let Some(h) = streams::run(&front, &rt, c, k, s.system.label())? {
                let i = idle::Idle {
                    streams: h.streams,
                    stream_bytes: Some(h.bytes),
                    ..idle::Idle::default()
                };
                s.idle = Some(s.idle.map_or(i, |o| o.merge(i)));
            }
        }
        Part::H2 => {
            let url = format!("http://{}{SMALL}", front.h2c);
            s.h2 = Some(h2load::run(&url, args, &[], &front, &bed.dir)?);
        }
        Part::H2Tls => {
            let Some(addr) = front.https else {
                return Ok(());
            };
            let url = format!("https://{addr}{SMALL}");
            s.h2_tls = Some(h2load::run(&url, args, &[], &front, &bed.dir)?);
        }
        Part::Grpc => {
            let url = format!("http://{}{GRPC_PATH}", front.grpc);
            let body = bed.dir.join("grpc-message");
            std::fs::write(&body, GRPC_MESSAGE)?;
            let body = body.to_string_lossy().into_owned();
            let extra = [
                "-d",
                &body,
                "-H",
                "content-type: application/grpc",
                "-H",
                "te: trailers",
            ];
            h2load::warm(&url, &extra)?;
            s.grpc = Some(h2load::run(&url, args, &extra, &front, &bed.dir)?);
        }
    }
    Ok(())
}
