//! The processes a benchmark starts, and what they need from this one: children that cannot
//! outlive the benchmark, waiting until something started is ready, enough file descriptors.

use crate::undo;
use anyhow::{Context, Result, bail};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A child process in its own process group, its output in a log file; dropping it kills the
/// whole group (nginx's master leaves its workers behind otherwise). The group is registered
/// in [`undo`], since Ctrl-C at the terminal does not reach it.
pub struct Proc {
    child: Child,
    reaped: bool,
}

impl Proc {
    pub fn spawn(cmd: &mut Command, log: &Path) -> Result<Proc> {
        use std::os::unix::process::CommandExt;
        let log = std::fs::File::create(log)?;
        // Held across the spawn, so that an interruption either finds the child or comes
        // before it exists.
        let mut undo = undo::lock();
        let child = cmd
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {cmd:?}"))?;
        undo.add_group(rustix::process::Pid::from_child(&child));
        Ok(Proc {
            child,
            reaped: false,
        })
    }

    /// The process ID, which is also its group's ID.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// How the process ended, if it has (it is reaped then).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        if self.reaped {
            return None;
        }
        let status = self.child.try_wait().ok().flatten()?;
        self.reaped = true;
        undo::lock().remove_group(rustix::process::Pid::from_child(&self.child));
        Some(status)
    }

    pub fn kill(&mut self) {
        // Once reaped, the group ID may belong to someone else.
        if std::mem::replace(&mut self.reaped, true) {
            return;
        }
        let pid = rustix::process::Pid::from_child(&self.child);
        undo::lock().remove_group(pid);
        let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Children in this process's own group (Ctrl-C reaches them), killed and reaped when dropped.
#[derive(Default)]
pub struct Reaper(pub Vec<Child>);

impl Drop for Reaper {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Runs a system tool (`ip`, `tc`) to completion; an error with its stderr if it fails.
/// `missing` says what to do when the tool is not there.
pub fn run_tool(program: &str, args: &[&str], missing: &str) -> Result<()> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("running {program} ({missing})"))?;
    if !out.status.success() {
        bail!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Polls `ready` every 20 ms until it holds; an error naming `what` after `limit`.
pub fn wait_for(what: &str, limit: Duration, mut ready: impl FnMut() -> bool) -> Result<()> {
    let start = Instant::now();
    while !ready() {
        if start.elapsed() > limit {
            bail!("{what}: not ready within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Raises the open-file limit as far as allowed (root: to `want`): a registrar benchmark with
/// tens of thousands of connections needs one descriptor each.
pub fn raise_nofile_limit(want: u64) -> u64 {
    use rlimit::Resource;
    let (soft, hard) = Resource::NOFILE.get().unwrap_or((1024, 1024));
    if soft >= want {
        return soft;
    }
    if hard < want && Resource::NOFILE.set(want, want).is_ok() {
        return want;
    }
    let _ = Resource::NOFILE.set(hard.min(want).max(soft), hard);
    Resource::NOFILE.get().map_or(soft, |(s, _)| s)
}
