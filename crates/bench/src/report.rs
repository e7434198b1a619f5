//! What every benchmark's results section says about where it came from (the command, the
//! machine, the date), and how a section is written into a Markdown file such as
//! docs/BENCHMARKS.md without touching the prose around it.

use anyhow::{Context, Result};
use std::fmt::Write;
use std::path::Path;

/// The command as the user typed it, for the results file.
pub fn command_line() -> String {
    let args = std::env::args().skip(1).collect::<Vec<_>>().join(" ");
    format!("cargo run --release -p rserpool-bench -- {args}")
}

/// Describes this machine for the results file.
pub fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    format!("{cpu}, {cores} cores, Linux {kernel}")
}

/// Today's date from the system clock, as YYYY-MM-DD.
pub fn today() -> String {
    let (y, m, d, _) = rserpool::util::utc_now();
    format!("{y:04}-{m:02}-{d:02}")
}

/// The lines that open a results section: command, machine and date, then a blank line.
pub fn provenance() -> String {
    let mut s = String::new();
    let _ = writeln!(s, "Command: `{}`  ", command_line());
    let _ = writeln!(s, "Machine: {}  ", machine());
    let _ = writeln!(s, "Date: {} (UTC)\n", today());
    s
}

/// Replaces the generated section `name` of a Markdown file (between its markers), appending
/// the section if the file does not have it yet.
pub fn write_section(path: &Path, name: &str, section: &str) -> Result<()> {
    let begin = format!("<!-- bench {name}: begin (generated) -->");
    let end = format!("<!-- bench {name}: end -->");
    let old = std::fs::read_to_string(path).unwrap_or_default();
    let block = format!("{begin}\n{section}{end}");
    let new = match (old.find(&begin), old.find(&end)) {
        (Some(b), Some(e)) if e > b => format!("{}{block}{}", &old[..b], &old[e + end.len()..]),
        _ => format!("{old}\n{block}\n"),
    };
    std::fs::write(path, new).with_context(|| format!("writing {}", path.display()))
}

/// The median of `v`, `None` if it is empty.
pub fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}
