//! h2load (Debian's nghttp2-client), the load generator for HTTP/2: one run, its summary and
//! its per-request log read (h2load reports no percentiles itself), and the proxy's cost per
//! request beside them.

use super::args::ProxyBenchArgs;
use super::cost::Cost;
use super::front::Front;
use super::wrk::Wrk;
use anyhow::{Context, Result, anyhow, bail};
use std::path::Path;
use std::process::Command;

/// One h2load run against `url` with the benchmark's threads and connections, `--streams`
/// concurrent streams per connection; `extra` are more arguments (a body, headers).
pub(super) fn run(
    url: &str,
    args: &ProxyBenchArgs,
    extra: &[&str],
    front: &Front,
    dir: &Path,
) -> Result<Wrk> {
    let log = dir.join("h2load.log");
    let _ = std::fs::remove_file(&log);
    let cost = Cost::start(front, args)?;
    let out = Command::new("h2load")
        .args(["-t", &args.threads.to_string()])
        .args(["-c", &args.connections.max(args.threads).to_string()])
        .args(["-m", &args.streams.to_string()])
        .args(["-D", &args.duration_s.max(1).to_string()])
        .arg("--log-file")
        .arg(&log)
        .args(extra)
        .arg(url)
        .output()
        .context("running h2load")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "h2load failed: {}{text}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut w =
        parse_summary(&text).ok_or_else(|| anyhow!("cannot read h2load's output:\n{text}"))?;
    let mut times: Vec<f64> = std::fs::read_to_string(&log)?
        .lines()
        .filter_map(|l| l.split('\t').nth(2)?.trim().parse::<f64>().ok())
        .collect();
    times.sort_by(f64::total_cmp);
    let pct =
        |p: f64| times.get(((times.len() as f64 * p) as usize).min(times.len().saturating_sub(1)));
    w.p50_ms = pct(0.5).map_or(0.0, |us| us / 1e3);
    w.p99_ms = pct(0.99).map_or(0.0, |us| us / 1e3);
    cost.finish(&mut w, args.duration_s);
    Ok(w)
}

/// Requests/s from "finished in …, N req/s, …"; errors: failed, errored, timed out and
/// non-2xx answers.
fn parse_summary(text: &str) -> Option<Wrk> {
    let mut w = Wrk::default();
    let mut rps = None;
    for line in text.lines() {
        let t = line.trim();
        if let Some(v) = t.strip_prefix("finished in") {
            rps = v
                .split(',')
                .nth(1)?
                .trim()
                .strip_suffix("req/s")?
                .trim()
                .parse()
                .ok();
        } else if let Some(v) = t.strip_prefix("requests:") {
            for part in v.split(',') {
                let mut it = part.split_whitespace();
                let (n, what) = (it.next()?.parse::<u64>().ok()?, it.next()?);
                if matches!(what, "failed" | "errored" | "timeout") {
                    w.errors += n;
                }
            }
        } else if let Some(v) = t.strip_prefix("status codes:") {
            for part in v.split(',') {
                let mut it = part.split_whitespace();
                let (n, what) = (it.next()?.parse::<u64>().ok()?, it.next()?);
                if what != "2xx" {
                    w.errors += n;
                }
            }
        }
    }
    w.rps = rps?;
    Some(w)
}

/// Waits (up to 15 s) until 30 requests in a row to `url` succeed: the proxy has found the
/// pool's backends.
pub(super) fn warm(url: &str, extra: &[&str]) -> Result<()> {
    let start = std::time::Instant::now();
    loop {
        let out = Command::new("h2load")
            .args(["-n", "30", "-c", "1"])
            .args(extra)
            .arg(url)
            .output()
            .context("running h2load")?;
        let text = String::from_utf8_lossy(&out.stdout);
        if parse_summary(&text).is_some_and(|w| w.errors == 0) && text.contains("30 succeeded") {
            return Ok(());
        }
        if start.elapsed() > std::time::Duration::from_secs(15) {
            bail!("{url} did not answer 30 requests in a row within 15 s:\n{text}");
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_h2load_output() {
        let out = "finished in 5.00s, 52877.11 req/s, 19.38MB/s
requests: 264385 total, 264395 started, 264385 done, 264380 succeeded, 5 failed, 0 errored, 1 timeout
status codes: 264380 2xx, 0 3xx, 2 4xx, 0 5xx
";
        let w = parse_summary(out).unwrap();
        assert_eq!(w.rps, 52877.11);
        assert_eq!(w.errors, 8);
        assert!(parse_summary("garbage").is_none());
    }
}
