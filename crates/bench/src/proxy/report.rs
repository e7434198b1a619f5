//! The proxy benchmark's report: a line per system and part while it runs, then medians over
//! the rounds as a Markdown section (tables, ratios, the targets in docs/BENCHMARKS.md) and bar charts.

use super::SMALL_SIZE;
use super::Sample;
use super::args::{ProxyBenchArgs, System};
use super::failover::Failover;
use super::load::Transfer;
use crate::plot;
use crate::report::{command_line, machine, median, today};
use anyhow::Result;

/// One line per system as its part is measured.
pub(super) fn print_sample(s: &Sample) {
    let mut line = format!("{:>8} round {}:", s.system.label(), s.round + 1);
    let syscalls = |w: &super::Wrk| {
        let mut t = w
            .syscalls
            .map(|n| format!(", {n:.2} system calls"))
            .unwrap_or_default();
        if let (Some(us), Some(busy)) = (w.machine_us, w.machine_busy) {
            t += &format!(", machine {us:.1} µs ({:.0} % busy)", 100.0 * busy);
        }
        t
    };
    let keepalive = |proto: &str, w: &super::Wrk| {
        format!(
            " {proto}keep-alive {:.0} req/s p50 {:.2} ms p99 {:.2} ms ({} errors), {:.1} µs CPU/req{};",
            w.rps,
            w.p50_ms,
            w.p99_ms,
            w.errors,
            w.cpu_us.unwrap_or(0.0),
            syscalls(w)
        )
    };
    let connect = |proto: &str, w: &super::Wrk| {
        format!(
            " {proto}{:.0} conn/s ({} errors), {:.1} µs CPU/conn{};",
            w.rps,
            w.errors,
            w.cpu_us.unwrap_or(0.0),
            syscalls(w)
        )
    };
    for (proto, ka, conn) in [
        ("", &s.keepalive, &s.connect),
        ("HTTPS ", &s.https_keepalive, &s.https_connect),
    ] {
        line += &ka.as_ref().map(|w| keepalive(proto, w)).unwrap_or_default();
        line += &conn.as_ref().map(|w| connect(proto, w)).unwrap_or_default();
    }
    for (proto, w) in [("h2c ", &s.h2), ("h2 TLS ", &s.h2_tls), ("gRPC ", &s.grpc)] {
        line += &w.as_ref().map(|w| keepalive(proto, w)).unwrap_or_default();
    }
    if let Some(b) = s.bulk_mib_s {
        line += &format!(" TCP bulk {b:.0} MiB/s");
        if let Some(busy) = s.bulk_busy {
            line += &format!(" (machine {:.0} % busy)", 100.0 * busy);
        }
        line += ";";
    }
    if let Some(b) = s.bulk_link_mib_s {
        line += &format!(" over rate-limited hops {b:.1} MiB/s;");
    }
    for t in &s.transfers {
        line += &format!(
            " {} {} MiB avg {:.2} s total {:.2} s ({} failed);",
            t.method, t.mib, t.avg_s, t.total_s, t.failed
        );
    }
    if let Some(i) = &s.idle {
        let kib = |b: Option<f64>| b.map_or("–".into(), |b| format!("{:.1} KiB", b / 1024.0));
        if i.h1_bytes.is_some() || i.h2_bytes.is_some() || i.tls_bytes.is_some() {
            line += &format!(
                " {} idle connections: {} each over HTTP/1.1, {} over HTTP/2, {} over HTTPS;",
                i.connections,
                kib(i.h1_bytes),
                kib(i.h2_bytes),
                kib(i.tls_bytes)
            );
        }
        if i.stream_bytes.is_some() {
            line += &format!(
                " {} HTTP/2 streams held: {} each;",
                i.streams,
                kib(i.stream_bytes)
            );
        }
    }
    if let Some(f) = &s.failover {
        line += &format!(
            " failover: {} of {} failed, visible {:?} ms, off {:?} ms, connects {} + {} (at {:?} ms)",
            f.failed,
            f.requests,
            f.visible_ms,
            f.off_ms,
            f.burst_connects,
            f.later_connects,
            f.later_at_ms
        );
    }
    println!("{line}");
}

/// A named figure of a row.
type Metric<'a> = (&'a str, &'a dyn Fn(&Row) -> Option<f64>);

/// (method, MiB)
type TransferKind = (&'static str, usize);
/// (average s, total s, failed transfers)
type TransferMedian = (f64, f64, usize);

/// Medians of an h2load part over the rounds, and its errors in all rounds.
#[derive(Default)]
struct H2Median {
    rps: Option<f64>,
    p50: Option<f64>,
    p99: Option<f64>,
    cpu: Option<f64>,
    syscalls: Option<f64>,
    machine: Option<f64>,
    errors: u64,
}

impl H2Median {
    fn of(runs: &[super::Wrk]) -> H2Median {
        let m =
            |f: &dyn Fn(&super::Wrk) -> Option<f64>| median(runs.iter().filter_map(f).collect());
        H2Median {
            rps: m(&|w| Some(w.rps)),
            p50: m(&|w| Some(w.p50_ms)),
            p99: m(&|w| Some(w.p99_ms)),
            cpu: m(&|w| w.cpu_us),
            syscalls: m(&|w| w.syscalls),
            machine: m(&|w| w.machine_us),
            errors: runs.iter().map(|w| w.errors).sum(),
        }
    }
}

/// Medians per system over the rounds.
struct Row {
    system: System,
    ka_rps: Option<f64>,
    ka_p50: Option<f64>,
    ka_p99: Option<f64>,
    ka_errors: u64,
    ka_cpu: Option<f64>,
    ka_sys: Option<f64>,
    ka_machine: Option<f64>,
    conn_s: Option<f64>,
    conn_cpu: Option<f64>,
    conn_sys: Option<f64>,
    conn_machine: Option<f64>,
    conn_errors: u64,
    tls_ka_rps: Option<f64>,
    tls_ka_p99: Option<f64>,
    tls_ka_cpu: Option<f64>,
    tls_ka_sys: Option<f64>,
    tls_ka_errors: u64,
    tls_conn_s: Option<f64>,
    tls_conn_cpu: Option<f64>,
    tls_conn_sys: Option<f64>,
    tls_conn_errors: u64,
    h2: H2Median,
    h2_tls: H2Median,
    grpc: H2Median,
    bulk: Option<f64>,
    bulk_busy: Option<f64>,
    bulk_link: Option<f64>,
    transfers: Vec<(TransferKind, TransferMedian)>,
    failover: Vec<Failover>,
    /// Resident bytes per idle connection, HTTP/1.1, HTTP/2 and HTTPS (medians), and how
    /// many.
    idle_h1: Option<f64>,
    idle_h2: Option<f64>,
    idle_tls: Option<f64>,
    idle_n: Option<usize>,
    /// Resident bytes per HTTP/2 stream held (median), and how many.
    stream: Option<f64>,
    streams_n: Option<usize>,
}

/// The medians of every system over the rounds, ready to be written out.
pub(super) struct Report {
    rows: Vec<Row>,
    rounds: usize,
    link_mbit: u64,
}

impl Report {
    pub(super) fn new(args: &ProxyBenchArgs, samples: &[Sample], sizes: &[usize]) -> Report {
        let rows = args
            .systems
            .iter()
            .map(|&system| {
                let of: Vec<&Sample> = samples.iter().filter(|s| s.system == system).collect();
                let m = |f: &dyn Fn(&Sample) -> Option<f64>| {
                    median(of.iter().filter_map(|s| f(s)).collect())
                };
                let mut transfers = Vec::new();
                for &mib in sizes {
                    for method in ["PUT", "GET"] {
                        let ts: Vec<&Transfer> = of
                            .iter()
                            .flat_map(|s| &s.transfers)
                            .filter(|t| t.method == method && t.mib == mib)
                            .collect();
                        if let (Some(a), Some(t)) = (
                            median(ts.iter().map(|t| t.avg_s).collect()),
                            median(ts.iter().map(|t| t.total_s).collect()),
                        ) {
                            let failed = ts.iter().map(|t| t.failed).sum();
                            transfers.push(((method, mib), (a, t, failed)));
                        }
                    }
                }
                Row {
                    system,
                    ka_rps: m(&|s| s.keepalive.map(|w| w.rps)),
                    ka_p50: m(&|s| s.keepalive.map(|w| w.p50_ms)),
                    ka_p99: m(&|s| s.keepalive.map(|w| w.p99_ms)),
                    ka_errors: of
                        .iter()
                        .filter_map(|s| s.keepalive)
                        .map(|w| w.errors)
                        .sum(),
                    ka_cpu: m(&|s| s.keepalive.and_then(|w| w.cpu_us)),
                    ka_sys: m(&|s| s.keepalive.and_then(|w| w.syscalls)),
                    ka_machine: m(&|s| s.keepalive.and_then(|w| w.machine_us)),
                    conn_s: m(&|s| s.connect.map(|w| w.rps)),
                    conn_cpu: m(&|s| s.connect.and_then(|w| w.cpu_us)),
                    conn_sys: m(&|s| s.connect.and_then(|w| w.syscalls)),
                    conn_machine: m(&|s| s.connect.and_then(|w| w.machine_us)),
                    conn_errors: of.iter().filter_map(|s| s.connect).map(|w| w.errors).sum(),
                    tls_ka_rps: m(&|s| s.https_keepalive.map(|w| w.rps)),
                    tls_ka_p99: m(&|s| s.https_keepalive.map(|w| w.p99_ms)),
                    tls_ka_cpu: m(&|s| s.https_keepalive.and_then(|w| w.cpu_us)),
                    tls_ka_sys: m(&|s| s.https_keepalive.and_then(|w| w.syscalls)),
                    tls_ka_errors: of
                        .iter()
                        .filter_map(|s| s.https_keepalive)
                        .map(|w| w.errors)
                        .sum(),
                    tls_conn_s: m(&|s| s.https_connect.map(|w| w.rps)),
                    tls_conn_cpu: m(&|s| s.https_connect.and_then(|w| w.cpu_us)),
                    tls_conn_sys: m(&|s| s.https_connect.and_then(|w| w.syscalls)),
                    tls_conn_errors: of
                        .iter()
                        .filter_map(|s| s.https_connect)
                        .map(|w| w.errors)
                        .sum(),
                    h2: H2Median::of(&of.iter().filter_map(|s| s.h2).collect::<Vec<_>>()),
                    h2_tls: H2Median::of(&of.iter().filter_map(|s| s.h2_tls).collect::<Vec<_>>()),
                    grpc: H2Median::of(&of.iter().filter_map(|s| s.grpc).collect::<Vec<_>>()),
                    bulk: m(&|s| s.bulk_mib_s),
                    bulk_busy: m(&|s| s.bulk_busy),
                    bulk_link: m(&|s| s.bulk_link_mib_s),
                    transfers,
                    failover: of.iter().filter_map(|s| s.failover.clone()).collect(),
                    idle_h1: m(&|s| s.idle.and_then(|i| i.h1_bytes)),
                    idle_h2: m(&|s| s.idle.and_then(|i| i.h2_bytes)),
                    idle_tls: m(&|s| s.idle.and_then(|i| i.tls_bytes)),
                    idle_n: of
                        .iter()
                        .filter_map(|s| s.idle)
                        .find(|i| {
                            i.h1_bytes.is_some() || i.h2_bytes.is_some() || i.tls_bytes.is_some()
                        })
                        .map(|i| i.connections),
                    stream: m(&|s| s.idle.and_then(|i| i.stream_bytes)),
                    streams_n: of
                        .iter()
                        .filter_map(|s| s.idle)
                        .find(|i| i.stream_bytes.is_some())
                        .map(|i| i.streams),
                }
            })
            .collect();
        Report {
            rows,
            rounds: args.repeat,
            link_mbit: args.link_mbit,
        }
    }

    /// The transfers measured, in the order they ran.
    fn transfer_kinds(&self) -> Vec<TransferKind> {
        let mut kinds = Vec::new();
        for (k, _) in self.rows.iter().flat_map(|r| &r.transfers) {
            if !kinds.contains(k) {
                kinds.push(*k);
            }
        }
        kinds
    }

    fn row(&self, s: System) -> Option<&Row> {
        self.rows.iter().find(|r| r.system == s)
    }

    pub(super) fn markdown(&self, args: &ProxyBenchArgs, versions: &str) -> String {
        let mut md = String::new();
        let date = today();
        md += "### Results (`rserpool-bench proxy`)\n\n";
        md += &format!(
            "Command: `{}` ({date}). Machine: {}. {versions}.\n\n",
            command_line(),
            machine()
        );
        let cols: Vec<&Row> = self.rows.iter().collect();
        if args.parts.iter().all(|p| p.is_memory()) {
            // Only memory: no throughput tables to head.
            return md + &self.idle(&cols) + &self.targets();
        }
        md += &format!(
            "Everything on this one machine over loopback: three nginx backends (one worker \
             each, a {SMALL_SIZE}-byte static file, large files, WebDAV PUT into tmpfs), each \
             registered by an `rserpool serve` sidecar; every proxy with {t} worker thread(s) \
             (rserpool `threads`, HAProxy `nbthread`, nginx `worker_processes`), round robin, \
             keep-alive to the backends (HAProxy `http-reuse always`, nginx `keepalive 256`), \
             X-Forwarded-For added by all three; wrk with {t} thread(s) and {c} connections for \
             {d} s. *Direct* is the client talking to the backends itself. Each part meets \
             the systems back to back, every proxy started afresh for it; medians of {r} \
             round(s).\n\n",
            t = args.threads,
            c = args.connections,
            d = args.duration_s,
            r = self.rounds
        );
        if args.parts.iter().any(|p| p.is_h2()) {
            md += &format!(
                "HTTP/2 parts: h2load with {t} thread(s), {c} connections and {m} concurrent \
                 streams on each for {d} s; HTTP/2 from the client, HTTP/1.1 to the nginx \
                 backends (h2c: rserpool and nginx on a listener of their own, HAProxy with \
                 `proto h2`; over TLS by ALPN). The gRPC part sends unary calls (a 5-byte \
                 message, `content-type: application/grpc`, `te: trailers`) over HTTP/2 both \
                 ways to three HTTP/2 backends that echo it with `grpc-status: 0` trailers \
                 (`rserpool-bench grpc-backend`; rserpool `protocol = \"h2\"`, HAProxy \
                 `proto h2`, nginx `grpc_pass`; the bare h2 relay, where it runs, takes the \
                 backends in turn on one connection each).\n\n",
                t = args.threads,
                c = args.connections,
                m = args.streams,
                d = args.duration_s,
            );
        }
        let header = |first: &str| {
            let mut h = format!("| {first} |");
            let mut sep = String::from("|---|");
            for r in &cols {
                h += &format!(" {} |", r.system.label());
                sep += "---|";
            }
            format!("{h}\n{sep}\n")
        };
        let line = |name: &str, f: &dyn Fn(&Row) -> String| {
            let mut l = format!("| {name} |");
            for r in &cols {
                l += &format!(" {} |", f(r));
            }
            l + "\n"
        };
        let num = |v: Option<f64>, prec: usize| v.map_or("–".into(), |v| format!("{v:.prec$}"));
        md += &header("");
        type Part<'a> = &'a dyn Fn(&Row) -> &H2Median;
        let h2_parts: [(&str, Part); 3] = [
            ("HTTP/2 cleartext (h2c)", &|r: &Row| &r.h2),
            ("HTTP/2 over TLS", &|r: &Row| &r.h2_tls),
            ("gRPC unary (h2 to h2 backends)", &|r: &Row| &r.grpc),
        ];
        for (name, part) in h2_parts {
            if cols.iter().all(|r| part(r).rps.is_none()) {
                continue;
            }
            md += &line(&format!("{name}, req/s"), &|r| num(part(r).rps, 0));
            md += &line(&format!("{name}, p50 ms"), &|r| num(part(r).p50, 2));
            md += &line(&format!("{name}, p99 ms"), &|r| num(part(r).p99, 2));
            md += &line(&format!("{name}, proxy CPU µs per request"), &|r| {
                num(part(r).cpu, 1)
            });
            if cols.iter().any(|r| part(r).syscalls.is_some()) {
                md += &line(&format!("{name}, proxy system calls per request"), &|r| {
                    num(part(r).syscalls, 2)
                });
            }
            md += &line(&format!("{name}, machine CPU µs per request"), &|r| {
                num(part(r).machine, 1)
            });
            md += &line(&format!("{name}, errors (all rounds)"), &|r| {
                part(r).errors.to_string()
            });
        }
        if cols.iter().any(|r| r.ka_rps.is_some()) {
            md += &line("keep-alive, req/s", &|r| num(r.ka_rps, 0));
            md += &line("keep-alive, p50 ms", &|r| num(r.ka_p50, 2));
            md += &line("keep-alive, p99 ms", &|r| num(r.ka_p99, 2));
            md += &line("keep-alive, errors (all rounds)", &|r| {
                r.ka_errors.to_string()
            });
            md += &line("keep-alive, proxy CPU µs per request", &|r| {
                num(r.ka_cpu, 1)
            });
            if cols.iter().any(|r| r.ka_sys.is_some()) {
                md += &line("keep-alive, proxy system calls per request", &|r| {
                    num(r.ka_sys, 2)
                });
            }
            md += &line("keep-alive, machine CPU µs per request", &|r| {
                num(r.ka_machine, 1)
            });
            md += &line("new connection per request, conn/s", &|r| num(r.conn_s, 0));
            md += &line("new connection per request, errors (all rounds)", &|r| {
                r.conn_errors.to_string()
            });
            md += &line(
                "new connection per request, proxy CPU µs per connection",
                &|r| num(r.conn_cpu, 1),
            );
            if cols.iter().any(|r| r.conn_sys.is_some()) {
                md += &line(
                    "new connection per request, proxy system calls per connection",
                    &|r| num(r.conn_sys, 2),
                );
            }
            md += &line(
                "new connection per request, machine CPU µs per connection",
                &|r| num(r.conn_machine, 1),
            );
        }
        if cols
            .iter()
            .any(|r| r.tls_ka_rps.is_some() || r.tls_conn_s.is_some())
        {
            md += &line("HTTPS keep-alive, req/s", &|r| num(r.tls_ka_rps, 0));
            md += &line("HTTPS keep-alive, p99 ms", &|r| num(r.tls_ka_p99, 2));
            md += &line("HTTPS keep-alive, proxy CPU µs per request", &|r| {
                num(r.tls_ka_cpu, 1)
            });
            if cols.iter().any(|r| r.tls_ka_sys.is_some()) {
                md += &line("HTTPS keep-alive, proxy system calls per request", &|r| {
                    num(r.tls_ka_sys, 2)
                });
            }
            md += &line("HTTPS keep-alive, errors (all rounds)", &|r| {
                r.tls_ka_errors.to_string()
            });
            md += &line("HTTPS new connection per request, conn/s", &|r| {
                num(r.tls_conn_s, 0)
            });
            md += &line(
                "HTTPS new connection per request, proxy CPU µs per connection",
                &|r| num(r.tls_conn_cpu, 1),
            );
            if cols.iter().any(|r| r.tls_conn_sys.is_some()) {
                md += &line(
                    "HTTPS new connection per request, proxy system calls per connection",
                    &|r| num(r.tls_conn_sys, 2),
                );
            }
            md += &line(
                "HTTPS new connection per request, errors (all rounds)",
                &|r| r.tls_conn_errors.to_string(),
            );
        }
        let bulk = cols
            .iter()
            .any(|r| r.bulk.is_some() || r.bulk_link.is_some());
        if bulk {
            md += &line(
                &format!(
                    "TCP mode bulk, {} connections, MiB/s",
                    args.bulk_connections
                ),
                &|r| num(r.bulk, 0),
            );
            md += &line("TCP mode bulk, machine CPU busy (all cores)", &|r| {
                r.bulk_busy
                    .map_or("–".into(), |b| format!("{:.0} %", 100.0 * b))
            });
        }
        if bulk && args.link_mbit > 0 {
            md += &line(
                &format!(
                    "TCP mode bulk, every hop limited to {} Mbit/s, MiB/s",
                    args.link_mbit
                ),
                &|r| num(r.bulk_link, 1),
            );
        }
        md += "\n";
        // Ratios.
        let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) if b > 0.0 => format!("{:.2}×", a / b),
            _ => "–".into(),
        };
        let get = |s: System, f: &dyn Fn(&Row) -> Option<f64>| self.row(s).and_then(f);
        md += "| ratio | rserpool / HAProxy | rserpool / nginx | rserpool / direct | HAProxy / direct | nginx / direct |\n|---|---|---|---|---|---|\n";
        let metrics: [Metric; 30] = [
            ("h2c req/s", &|r: &Row| r.h2.rps),
            ("h2c p99 (lower is better)", &|r: &Row| r.h2.p99),
            ("h2c CPU per request (lower is better)", &|r: &Row| r.h2.cpu),
            (
                "h2c system calls per request (lower is better)",
                &|r: &Row| r.h2.syscalls,
            ),
            (
                "h2c machine CPU per request (lower is better)",
                &|r: &Row| r.h2.machine,
            ),
            ("h2 over TLS req/s", &|r: &Row| r.h2_tls.rps),
            ("h2 over TLS p99 (lower is better)", &|r: &Row| r.h2_tls.p99),
            (
                "h2 over TLS system calls per request (lower is better)",
                &|r: &Row| r.h2_tls.syscalls,
            ),
            ("gRPC calls/s", &|r: &Row| r.grpc.rps),
            ("gRPC p99 (lower is better)", &|r: &Row| r.grpc.p99),
            ("gRPC CPU per call (lower is better)", &|r: &Row| r.grpc.cpu),
            (
                "gRPC system calls per call (lower is better)",
                &|r: &Row| r.grpc.syscalls,
            ),
            ("gRPC machine CPU per call (lower is better)", &|r: &Row| {
                r.grpc.machine
            }),
            ("keep-alive req/s", &|r: &Row| r.ka_rps),
            ("keep-alive p99 (lower is better)", &|r: &Row| r.ka_p99),
            (
                "keep-alive CPU per request (lower is better)",
                &|r: &Row| r.ka_cpu,
            ),
            (
                "keep-alive system calls per request (lower is better)",
                &|r: &Row| r.ka_sys,
            ),
            (
                "keep-alive machine CPU per request (lower is better)",
                &|r: &Row| r.ka_machine,
            ),
            ("conn/s", &|r: &Row| r.conn_s),
            ("CPU per connection (lower is better)", &|r: &Row| {
                r.conn_cpu
            }),
            (
                "system calls per connection (lower is better)",
                &|r: &Row| r.conn_sys,
            ),
            (
                "machine CPU per connection (lower is better)",
                &|r: &Row| r.conn_machine,
            ),
            ("HTTPS keep-alive req/s", &|r: &Row| r.tls_ka_rps),
            (
                "HTTPS keep-alive CPU per request (lower is better)",
                &|r: &Row| r.tls_ka_cpu,
            ),
            (
                "HTTPS keep-alive system calls per request (lower is better)",
                &|r: &Row| r.tls_ka_sys,
            ),
            ("HTTPS conn/s", &|r: &Row| r.tls_conn_s),
            ("HTTPS CPU per connection (lower is better)", &|r: &Row| {
                r.tls_conn_cpu
            }),
            (
                "HTTPS system calls per connection (lower is better)",
                &|r: &Row| r.tls_conn_sys,
            ),
            ("TCP bulk MiB/s", &|r: &Row| r.bulk),
            ("TCP bulk over rate-limited hops", &|r: &Row| r.bulk_link),
        ];
        for (name, f) in metrics {
            if self.rows.iter().all(|r| f(r).is_none()) {
                continue; // A part that did not run.
            }
            let (d, rs, h, n) = (
                get(System::Direct, f),
                get(System::Rserpool, f),
                get(System::Haproxy, f),
                get(System::Nginx, f),
            );
            md += &format!(
                "| {name} | {} | {} | {} | {} | {} |\n",
                ratio(rs, h),
                ratio(rs, n),
                ratio(rs, d),
                ratio(h, d),
                ratio(n, d)
            );
        }
        md += "\n";
        if self.row(System::Baseline).is_some() {
            md += "| change | rserpool / baseline (medians; the two alternate in every round) |\n|---|---|\n";
            for (name, f) in metrics {
                if self.rows.iter().all(|r| f(r).is_none()) {
                    continue;
                }
                let change = ratio(get(System::Rserpool, f), get(System::Baseline, f));
                md += &format!("| {name} | {change} |\n");
            }
            md += "\n";
        }
        if cols.iter().any(|r| !r.transfers.is_empty()) {
            md += &format!(
                "The seed paper's experiment (its Tables 2–3, 6–7): {} clients start one transfer \
                 each at the same moment; average time of a transfer / time until the last one \
                 finished, seconds (failed transfers in brackets when any). Direct clients \
                 spread over the three backends.\n\n",
                args.transfers
            );
            md += &header("transfer");
            for (method, mib) in self.transfer_kinds() {
                md += &line(&format!("{method} {mib} MiB"), &|r| {
                    r.transfers
                        .iter()
                        .find(|(k, _)| *k == (method, mib))
                        .map_or("–".into(), |(_, (a, t, failed))| {
                            let f = if *failed > 0 {
                                format!(" ({failed} failed)")
                            } else {
                                String::new()
                            };
                            format!("{a:.2} / {t:.2}{f}")
                        })
                });
            }
            md += "\n";
        }
        let fo: Vec<&Row> = cols
            .iter()
            .copied()
            .filter(|r| !r.failover.is_empty())
            .collect();
        if !fo.is_empty() {
            md += &format!(
                "Failover: {} keep-alive clients GET the small file through the proxy; after 1 s \
                 one backend is killed with SIGKILL and the run goes on for {} ms. Connection \
                 attempts to the dead backend are timestamped on a raw socket. *Visible*: kill → \
                 first refused attempt. *Traffic off*: first refused attempt → the last attempt \
                 before a pause of at least 500 ms. *Later*: attempts after that pause \
                 (back-off re-tries, health checks). One value per round.\n\n",
                args.failover_clients, args.failover_ms
            );
            md += "| | requests | failed | visible ms | traffic off ms | attempts in burst | later attempts |\n|---|---|---|---|---|---|---|\n";
            for r in fo {
                let all = |f: &dyn Fn(&Failover) -> String| {
                    r.failover.iter().map(f).collect::<Vec<_>>().join(", ")
                };
                let opt = |v: Option<f64>| v.map_or("no attempt".into(), |v| format!("{v:.0}"));
                md += &format!(
                    "| {} | {} | {} | {} | {} | {} | {} |\n",
                    r.system.label(),
                    all(&|f| f.requests.to_string()),
                    all(&|f| f.failed.to_string()),
                    all(&|f| opt(f.visible_ms)),
                    all(&|f| opt(f.off_ms)),
                    all(&|f| f.burst_connects.to_string()),
                    all(&|f| f.later_connects.to_string()),
                );
            }
            md += "\n";
        }
        md += &self.idle(&cols);
        md += &self.targets();
        md
    }

    /// The memory parts' table: KiB per idle connection and per HTTP/2 stream held, and the
    /// ratio to HAProxy's.
    fn idle(&self, cols: &[&Row]) -> String {
        let rows: Vec<&&Row> = cols
            .iter()
            .filter(|r| {
                r.idle_h1.is_some()
                    || r.idle_h2.is_some()
                    || r.idle_tls.is_some()
                    || r.stream.is_some()
            })
            .collect();
        if rows.is_empty() {
            return String::new();
        }
        let h = self.row(System::Haproxy);
        let cell = |v: Option<f64>, base: Option<f64>| match (v, base) {
            (Some(v), Some(b)) if b > 0.0 => format!("{:.1} ({:.2}×)", v / 1024.0, v / b),
            (Some(v), _) => format!("{:.1}", v / 1024.0),
            (None, _) => "–".into(),
        };
        let mut md = String::new();
        if let Some(n) = rows.iter().find_map(|r| r.idle_n) {
            md += &format!(
                "Idle connections: {n} clients each make one request and stay connected \
                 (HTTP/1.1, HTTP/2 with prior knowledge, HTTPS with HTTP/1.1 by ALPN, each \
                 protocol in a system started afresh); the system's resident memory (all its processes) before and after, per \
                 connection. "
            );
        }
        if let Some(n) = rows.iter().find_map(|r| r.streams_n) {
            md += &format!(
                "Streams held: {n} gRPC-shaped calls in all, on connections that made one call \
                 first, to a method the HTTP/2 backends never answer; the system's resident \
                 memory before and after, per stream (nginx's `grpc_pass` takes a backend \
                 connection per stream, HAProxy and rserpool multiplex). "
            );
        }
        md += "In KiB (ratio to HAProxy's); kernel socket buffers are not in it.\n\n\
               | | HTTP/1.1 KiB/idle conn | HTTP/2 KiB/idle conn | HTTPS KiB/idle conn | HTTP/2 \
               KiB/stream |\n\
               |---|---|---|---|---|\n";
        for r in rows {
            md += &format!(
                "| {} | {} | {} | {} | {} |\n",
                r.system.label(),
                cell(r.idle_h1, h.and_then(|h| h.idle_h1)),
                cell(r.idle_h2, h.and_then(|h| h.idle_h2)),
                cell(r.idle_tls, h.and_then(|h| h.idle_tls)),
                cell(r.stream, h.and_then(|h| h.stream)),
            );
        }
        md + "\n"
    }

    fn targets(&self) -> String {
        let (Some(r), Some(h)) = (self.row(System::Rserpool), self.row(System::Haproxy)) else {
            return String::new();
        };
        let d = self.row(System::Direct);
        let verdict = |ok: Option<bool>| match ok {
            Some(true) => "met",
            Some(false) => "**not met**",
            None => "not measured",
        };
        let ge = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| a >= b);
        let of_ratio = |a: Option<f64>, b: Option<f64>| {
            a.zip(b)
                .filter(|(_, b)| *b > 0.0)
                .map_or("–".into(), |(a, b)| format!("{:.2}×", a / b))
        };
        let mut t = String::from("Targets:\n\n");
        if r.h2.rps.is_some() || r.h2_tls.rps.is_some() {
            t += &format!(
                "- HTTP/2 requests/s ≥ 1.0× HAProxy's: {} in cleartext ({}), {} over \
                 TLS ({})\n",
                verdict(ge(r.h2.rps, h.h2.rps)),
                of_ratio(r.h2.rps, h.h2.rps),
                verdict(ge(r.h2_tls.rps, h.h2_tls.rps)),
                of_ratio(r.h2_tls.rps, h.h2_tls.rps),
            );
        }
        if r.idle_h1.is_some() || r.idle_h2.is_some() || r.idle_tls.is_some() {
            t += &format!(
                "- memory per idle connection ≤ HAProxy's: {} over HTTP/1.1 ({}), {} over \
                 HTTP/2 ({}), {} over HTTPS ({})\n",
                verdict(ge(h.idle_h1, r.idle_h1)),
                of_ratio(r.idle_h1, h.idle_h1),
                verdict(ge(h.idle_h2, r.idle_h2)),
                of_ratio(r.idle_h2, h.idle_h2),
                verdict(ge(h.idle_tls, r.idle_tls)),
                of_ratio(r.idle_tls, h.idle_tls),
            );
        }
        if r.stream.is_some() {
            t += &format!(
                "- memory per HTTP/2 stream ≤ HAProxy's: {} ({})\n",
                verdict(ge(h.stream, r.stream)),
                of_ratio(r.stream, h.stream),
            );
        }
        if r.grpc.rps.is_some() {
            t += "- gRPC unary calls/s against Envoy: not measured, Envoy cannot be \
                  installed here (no Debian package, no network beyond the package registries); \
                  HAProxy (`proto h2` to the backends) and nginx (`grpc_pass`) stand in\n";
        }
        if let Some(floor) = self.row(System::H2Relay).filter(|f| f.grpc.rps.is_some()) {
            t += &format!(
                "- the floor of the crates (`h2` both ways, tokio, mimalloc: a bare relay of the \
                 streams, `rserpool-bench h2-relay`): its CPU per call {} HAProxy's and its \
                 calls/s {}; rserpool's CPU per call {} the bare relay's (the proxy's own work)\n",
                of_ratio(floor.grpc.cpu, h.grpc.cpu),
                of_ratio(floor.grpc.rps, h.grpc.rps),
                of_ratio(r.grpc.cpu, floor.grpc.cpu),
            );
        }
        if r.ka_rps.is_none() && r.conn_s.is_none() {
            return t + "\n";
        }
        t += &format!(
            "- requests/s ≥ HAProxy's: {}\n- p99 ≤ HAProxy's: {}\n- connections/s ≥ HAProxy's: {}\n",
            verdict(ge(r.ka_rps, h.ka_rps)),
            verdict(ge(h.ka_p99, r.ka_p99)),
            verdict(ge(r.conn_s, h.conn_s)),
        );
        let of_direct = |a: Option<f64>, d: Option<f64>| {
            a.zip(d)
                .filter(|(_, d)| *d > 0.0)
                .map_or("–".into(), |(a, d)| format!("{:.2}×", a / d))
        };
        if r.tls_ka_rps.is_some() || r.tls_conn_s.is_some() {
            t += &format!(
                "- HTTPS keep-alive requests/s ≥ HAProxy's: {}\n- HTTPS new \
                 connections/s ≥ HAProxy's: {}\n",
                verdict(ge(r.tls_ka_rps, h.tls_ka_rps)),
                verdict(ge(r.tls_conn_s, h.tls_conn_s)),
            );
        }
        let direct_bulk = d.and_then(|d| d.bulk);
        let fo = (!r.failover.is_empty()).then_some(&r.failover);
        if r.bulk.is_none() && r.bulk_link.is_none() && fo.is_none() {
            return t + "\n";
        }
        t += "- TCP bulk ≥ 90 % of direct: ";
        if self.link_mbit > 0 {
            t += &format!(
                "{} where the network is the limit (every hop at {} Mbit/s, as on the seed's \
                 testbed: {} of direct); ",
                verdict(ge(
                    r.bulk_link,
                    d.and_then(|d| d.bulk_link).map(|b| 0.9 * b)
                )),
                self.link_mbit,
                of_direct(r.bulk_link, d.and_then(|d| d.bulk_link)),
            );
        }
        t += &format!(
            "{} on loopback ({} of direct), where direct alone keeps the machine {} busy and a \
             proxy's second TCP connection can only take from the same cores\n",
            verdict(ge(r.bulk, direct_bulk.map(|b| 0.9 * b))),
            of_direct(r.bulk, direct_bulk),
            d.and_then(|d| d.bulk_busy)
                .map_or("–".into(), |b| format!("{:.0} %", 100.0 * b)),
        );
        t += &format!(
            "- zero failed requests when a PE dies: {}\n- traffic off a dead PE within 200 ms of the failure being visible: {}\n\n",
            verdict(fo.map(|f| f.iter().all(|f| f.failed == 0))),
            verdict(fo.map(|f| f.iter().all(|f| f.off_ms.is_none_or(|m| m <= 200.0)))),
        );
        t
    }

    pub(super) fn plot(&self, prefix: &str) -> Result<()> {
        let direct = self.row(System::Direct);
        // Throughput relative to direct; direct's own bars (1.0) keep every system at the same
        // place and colour in all three charts.
        if let Some(d) = direct {
            let metrics: [Metric; 3] = [
                ("keep-alive req/s", &|r: &Row| r.ka_rps),
                ("new connection per request", &|r: &Row| r.conn_s),
                ("TCP bulk MiB/s", &|r: &Row| r.bulk),
            ];
            let groups: Vec<String> = metrics.iter().map(|m| m.0.to_string()).collect();
            let series: Vec<(String, Vec<f64>)> = self
                .rows
                .iter()
                .map(|r| {
                    let v = metrics
                        .iter()
                        .map(|(_, f)| match (f(r), f(d)) {
                            (Some(a), Some(b)) if b > 0.0 => a / b,
                            _ => 0.0,
                        })
                        .collect();
                    (r.system.label().to_string(), v)
                })
                .collect();
            plot::bars(
                &format!("{prefix}-throughput.png"),
                "Throughput through the proxy, relative to direct",
                "fraction of direct",
                &groups,
                &series,
            )?;
        }
        let series: Vec<(String, Vec<f64>)> = self
            .rows
            .iter()
            .map(|r| {
                (
                    r.system.label().to_string(),
                    vec![r.ka_p50.unwrap_or(0.0), r.ka_p99.unwrap_or(0.0)],
                )
            })
            .collect();
        plot::bars(
            &format!("{prefix}-latency.png"),
            "Keep-alive request latency (wrk)",
            "ms",
            &["p50".to_string(), "p99".to_string()],
            &series,
        )?;
        let kinds = self.transfer_kinds();
        if !kinds.is_empty() {
            let groups: Vec<String> = kinds.iter().map(|(m, s)| format!("{m} {s} MiB")).collect();
            let series: Vec<(String, Vec<f64>)> = self
                .rows
                .iter()
                .map(|r| {
                    let v = kinds
                        .iter()
                        .map(|k| {
                            r.transfers
                                .iter()
                                .find(|(kk, _)| kk == k)
                                .map_or(0.0, |(_, (a, _, _))| *a)
                        })
                        .collect();
                    (r.system.label().to_string(), v)
                })
                .collect();
            plot::bars(
                &format!("{prefix}-transfers.png"),
                "Average time of one of the concurrent transfers",
                "seconds",
                &groups,
                &series,
            )?;
        }
        Ok(())
    }
}
