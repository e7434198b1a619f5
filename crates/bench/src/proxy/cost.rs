//! What a run cost the proxy: its CPU time (all its processes and threads, from /proc),
//! the whole machine's CPU time beside it (/proc/stat) and, with `--syscalls`, its system
//! calls (`perf stat` on the `raw_syscalls:sys_enter`
//! tracepoint: every system call of the proxy's processes, whatever it is; counting starts
//! just before the load and stops just after it). System calls per request tell two proxies
//! apart where CPU time alone cannot say why: on loopback most of a proxy's time is the
//! kernel's TCP, and a write costs the receiver's work too.

use super::args::ProxyBenchArgs;
use super::front::Front;
use super::wrk::Wrk;
use crate::procfs::{group_cpu_ns, group_pids, machine_busy_s_since, machine_cpu_ticks};
use anyhow::{Context, Result, bail};
use std::process::{Child, Command, Stdio};

/// The proxy's counters from the start of a run.
pub(super) struct Cost {
    group: Option<u32>,
    cpu_at_start: Option<u64>,
    machine_at_start: Option<(u64, u64)>,
    perf: Option<Child>,
}

impl Cost {
    pub(super) fn start(front: &Front, args: &ProxyBenchArgs) -> Result<Cost> {
        let group = front.group();
        let perf = match group {
            Some(g) if args.syscalls => Some(count_syscalls(g)?),
            _ => None,
        };
        Ok(Cost {
            group,
            cpu_at_start: group.map(group_cpu_ns),
            machine_at_start: machine_cpu_ticks(),
            perf,
        })
    }

    /// Fills in the run's cost per request (none for direct), for a run of `duration_s` at
    /// `w.rps`.
    pub(super) fn finish(mut self, w: &mut Wrk, duration_s: u64) {
        let requests = (w.rps * duration_s.max(1) as f64).max(1.0);
        let machine = machine_busy_s_since(self.machine_at_start);
        w.machine_us = machine.map(|(s, _)| s * 1e6 / requests);
        w.machine_busy = machine.map(|(_, share)| share);
        if let (Some(g), Some(c0)) = (self.group, self.cpu_at_start) {
            w.cpu_us = Some(group_cpu_ns(g).saturating_sub(c0) as f64 / 1e3 / requests);
        }
        w.syscalls = self
            .perf
            .take()
            .and_then(stop_counting)
            .map(|n| n as f64 / requests);
    }
}

impl Drop for Cost {
    /// A run that failed leaves no `perf` behind.
    fn drop(&mut self) {
        if let Some(perf) = self.perf.take() {
            let _ = stop_counting(perf);
        }
    }
}

/// Whether `perf` can count system calls here (it needs root, or a low
/// `kernel.perf_event_paranoid`); checked once before the runs.
pub(super) fn check_syscalls() -> Result<()> {
    let out = Command::new("perf")
        .args(["stat", "-x,", "-e", "raw_syscalls:sys_enter", "--", "true"])
        .output()
        .context("--syscalls needs perf (Debian: linux-perf)")?;
    let text = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() || parse_count(&text).is_none() {
        bail!("--syscalls: perf cannot count system calls here (root?):\n{text}");
    }
    Ok(())
}

fn count_syscalls(group: u32) -> Result<Child> {
    let pids: Vec<String> = group_pids(group).iter().map(u32::to_string).collect();
    Command::new("perf")
        .args([
            "stat",
            "-x,",
            "-e",
            "raw_syscalls:sys_enter",
            "-p",
            &pids.join(","),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting perf stat")
}

/// Stops `perf stat` (it prints its count on SIGINT): the system calls it counted.
fn stop_counting(perf: Child) -> Option<u64> {
    let pid = rustix::process::Pid::from_raw(i32::try_from(perf.id()).ok()?)?;
    rustix::process::kill_process(pid, rustix::process::Signal::INT).ok()?;
    let out = perf.wait_with_output().ok()?;
    parse_count(&String::from_utf8_lossy(&out.stderr))
}

/// The count from `perf stat -x,` output: `COUNT,UNIT,EVENT,...`.
fn parse_count(text: &str) -> Option<u64> {
    text.lines()
        .find(|l| l.contains("raw_syscalls:sys_enter"))?
        .split(',')
        .next()?
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_perf_stat_csv() {
        let text = "423934,,raw_syscalls:sys_enter,5002316224,100.00,,\n";
        assert_eq!(super::parse_count(text), Some(423934));
        assert_eq!(
            super::parse_count("<not counted>,,raw_syscalls:sys_enter,0,0.00,,\n"),
            None
        );
    }
}
