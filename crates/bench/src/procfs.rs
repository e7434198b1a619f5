//! CPU time and resident memory of processes, and how busy the whole machine was, read from
//! /proc: what the benchmarks charge to the system under test.

use anyhow::{Result, anyhow};

/// CPU time of all threads of a process, ns (the sum of /proc/PID/task/*/schedstat).
pub fn cpu_ns(pid: u32) -> Result<u64> {
    let mut total = 0;
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let text = std::fs::read_to_string(t?.path().join("schedstat"))?;
        total += text
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or_else(|| anyhow!("bad schedstat"))?;
    }
    Ok(total)
}

/// CPU time of every thread of every process in process group `pgid`, ns: a system under test
/// may be several processes (nginx's master and workers).
pub fn group_cpu_ns(pgid: u32) -> u64 {
    group_pids(pgid)
        .into_iter()
        .map(|p| cpu_ns(p).unwrap_or(0))
        .sum()
}

/// Resident memory of every process in process group `pgid`, bytes.
pub fn group_rss_bytes(pgid: u32) -> u64 {
    group_pids(pgid)
        .into_iter()
        .map(|p| rss_bytes(p).unwrap_or(0))
        .sum()
}

/// The processes of process group `pgid`.
pub fn group_pids(pgid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids = Vec::new();
    for e in dir.flatten() {
        let path = e.path();
        let Ok(stat) = std::fs::read_to_string(path.join("stat")) else {
            continue;
        };
        // Fields after the command name (which may contain spaces): state, ppid, pgrp, …
        let pgrp = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(2))
            .and_then(|v| v.parse::<u32>().ok());
        if pgrp != Some(pgid) {
            continue;
        }
        if let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) {
            pids.push(pid);
        }
    }
    pids
}

/// Resident set size of a process, bytes (VmRSS of /proc/PID/status).
pub fn rss_bytes(pid: u32) -> Result<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb = text
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<u64>().ok())
        .ok_or_else(|| anyhow!("no VmRSS"))?;
    Ok(kb * 1024)
}

/// The machine's CPU counters (`/proc/stat`, all cores): (busy, total) in clock ticks.
pub fn machine_cpu_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    busy_total(stat.lines().next()?)
}

/// Each core's CPU counters, as [`machine_cpu_ticks`].
pub fn core_cpu_ticks() -> Vec<(u64, u64)> {
    let Ok(stat) = std::fs::read_to_string("/proc/stat") else {
        return Vec::new();
    };
    stat.lines()
        .skip(1)
        .take_while(|l| l.starts_with("cpu"))
        .filter_map(busy_total)
        .collect()
}

/// (busy, total) ticks of one `cpu…` line of /proc/stat.
fn busy_total(line: &str) -> Option<(u64, u64)> {
    let ticks: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal ...; idle and iowait are not busy.
    let total: u64 = ticks.iter().take(8).sum();
    let idle = ticks.get(3)? + ticks.get(4)?;
    Some((total - idle, total))
}

/// The share of the machine's CPU that was busy since `since` (from [`machine_cpu_ticks`]).
pub fn machine_busy_since(since: Option<(u64, u64)>) -> Option<f64> {
    let ((b0, t0), (b1, t1)) = since.zip(machine_cpu_ticks())?;
    (t1 > t0).then(|| (b1 - b0) as f64 / (t1 - t0) as f64)
}

/// CPU time the whole machine was busy since `since` (from [`machine_cpu_ticks`]), in
/// seconds summed over its cores (every process, the kernel's softirq work included), and
/// the busy share of its CPU, from one reading.
pub fn machine_busy_s_since(since: Option<(u64, u64)>) -> Option<(f64, f64)> {
    let ((b0, t0), (b1, t1)) = since.zip(machine_cpu_ticks())?;
    let busy = b1.saturating_sub(b0);
    let seconds = busy as f64 / rustix::param::clock_ticks_per_second() as f64;
    (t1 > t0).then(|| (seconds, busy as f64 / (t1 - t0) as f64))
}

/// The busiest core's busy share since `since` (from [`core_cpu_ticks`]).
pub fn busiest_core_since(since: &[(u64, u64)]) -> Option<f64> {
    since
        .iter()
        .zip(core_cpu_ticks())
        .filter(|((_, t0), (_, t1))| t1 > t0)
        .map(|((b0, t0), (b1, t1))| (b1 - b0) as f64 / (t1 - t0) as f64)
        .reduce(f64::max)
}
