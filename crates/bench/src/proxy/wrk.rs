//! wrk, the load generator for requests/s and connections/s: one run, its output read, and
//! the proxy's cost per request beside it.

use super::args::ProxyBenchArgs;
use super::cost::Cost;
use super::front::Front;
use anyhow::{Context, Result, anyhow, bail};
use serde::Serialize;
use std::process::Command;

/// What one wrk run measured.
#[derive(Serialize, Clone, Copy, Debug, Default)]
pub(crate) struct Wrk {
    pub(crate) rps: f64,
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
    /// The slowest request.
    pub(crate) max_ms: f64,
    /// Non-2xx answers and socket errors together.
    pub(crate) errors: u64,
    /// Socket errors: connect (refused), read, write, timeout.
    pub(crate) socket: [u64; 4],
    /// CPU time of the proxy (all its processes and threads) per request, µs.
    pub(crate) cpu_us: Option<f64>,
    /// System calls of the proxy per request (with `--syscalls`).
    pub(crate) syscalls: Option<f64>,
    /// CPU time of the whole machine per request, µs: the proxy, the client, the backends
    /// and the kernel's work for all of them. On a machine that runs them all near its limit,
    /// requests/s follow this rather than the proxy's own CPU time.
    pub(crate) machine_us: Option<f64>,
    /// The share of the machine's CPU (all cores) that was busy during the run.
    pub(crate) machine_busy: Option<f64>,
}

/// One wrk run; `close` sends `Connection: close` so that every request opens a connection.
pub(super) fn run(url: &str, args: &ProxyBenchArgs, close: bool, front: &Front) -> Result<Wrk> {
    let cost = Cost::start(front, args)?;
    let mut cmd = Command::new("wrk");
    cmd.args(["-t", &args.threads.to_string()])
        .args(["-c", &args.connections.max(args.threads).to_string()])
        .args(["-d", &format!("{}s", args.duration_s.max(1))])
        .arg("--latency");
    if close {
        cmd.args(["-H", "Connection: close"]);
    }
    let out = cmd.arg(url).output().context("running wrk")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!("wrk failed: {}{text}", String::from_utf8_lossy(&out.stderr));
    }
    let mut w = parse_wrk(&text).ok_or_else(|| anyhow!("cannot read wrk's output:\n{text}"))?;
    cost.finish(&mut w, args.duration_s);
    Ok(w)
}

pub(crate) fn parse_wrk(text: &str) -> Option<Wrk> {
    let mut w = Wrk::default();
    let mut rps = None;
    for line in text.lines() {
        let t = line.trim();
        if let Some(v) = t.strip_prefix("Requests/sec:") {
            rps = v.trim().parse().ok();
        } else if let Some(v) = t.strip_prefix("50%") {
            w.p50_ms = parse_duration_ms(v.trim())?;
        } else if let Some(v) = t.strip_prefix("99%") {
            w.p99_ms = parse_duration_ms(v.trim())?;
        } else if let Some(v) = t.strip_prefix("Non-2xx or 3xx responses:") {
            w.errors += v.trim().parse::<u64>().ok()?;
        } else if let Some(v) = t.strip_prefix("Socket errors:") {
            // "connect 0, read 0, write 0, timeout 0"
            for (i, part) in v.split(',').enumerate().take(4) {
                let n = part.split_whitespace().nth(1)?.parse::<u64>().ok()?;
                w.socket[i] = n;
                w.errors += n;
            }
        } else if let Some(v) = t.strip_prefix("Latency") {
            // Thread stats: "Latency   2.61ms  0.86ms  11.71ms  73.17%" (avg, stdev, max).
            if let Some(max) = v.split_whitespace().nth(2) {
                w.max_ms = parse_duration_ms(max)?;
            }
        }
    }
    w.rps = rps?;
    Some(w)
}

fn parse_duration_ms(v: &str) -> Option<f64> {
    let (num, scale) = if let Some(n) = v.strip_suffix("us") {
        (n, 1e-3)
    } else if let Some(n) = v.strip_suffix("ms") {
        (n, 1.0)
    } else if let Some(n) = v.strip_suffix('s') {
        (n, 1e3)
    } else if let Some(n) = v.strip_suffix('m') {
        (n, 60e3)
    } else {
        return None;
    };
    Some(num.trim().parse::<f64>().ok()? * scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_wrk_output() {
        let out = "Running 5s test @ http://127.0.0.1:1/small.html
  1 threads and 50 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     2.61ms    0.86ms  11.71ms   73.17%
  Latency Distribution
     50%  770.00us
     75%    1.00ms
     99%    2.50ms
  265000 requests in 5.00s, 30.00MB read
  Non-2xx or 3xx responses: 12
  Socket errors: connect 1, read 2, write 0, timeout 3
Requests/sec:  53000.50
Transfer/sec:      6.00MB
";
        let w = parse_wrk(out).unwrap();
        assert_eq!(w.rps, 53000.5);
        assert!((w.p50_ms - 0.77).abs() < 1e-9);
        assert_eq!(w.p99_ms, 2.5);
        assert_eq!(w.errors, 18);
        assert_eq!(w.socket, [1, 2, 0, 3]);
        assert_eq!(w.max_ms, 11.71);
        assert!(parse_wrk("garbage").is_none());
    }
}
