//! What an interrupted benchmark must undo. Processes started in their own process groups
//! (`process::Proc`) do not get the terminal's Ctrl-C; without this registry, Ctrl-C
//! or SIGTERM would leave them running, a rate limit on lo or network namespaces in place and
//! temporary directories behind. Whoever sets such a thing up registers it here and removes the entry when it undoes
//! it itself; [`on_signal`] undoes whatever is still registered.

use anyhow::Result;
use rustix::process::{Pid, Signal, kill_process_group};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// A command that undoes a change to the system, such as `tc qdisc del …`.
pub type Command = Vec<String>;

/// A [`Command`] from its words.
pub fn command(words: &[&str]) -> Command {
    words.iter().map(|w| w.to_string()).collect()
}

/// Runs an undo command; failure is ignored (what it undoes may never have been done).
pub fn run(c: &[String]) {
    if let Some((program, args)) = c.split_first() {
        let _ = std::process::Command::new(program)
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
    }
}

pub struct Undo {
    groups: Vec<Pid>,
    commands: Vec<Command>,
    dirs: Vec<PathBuf>,
}

static UNDO: Mutex<Undo> = Mutex::new(Undo {
    groups: Vec::new(),
    commands: Vec::new(),
    dirs: Vec::new(),
});

/// The registry; held across a change, so that an interruption finds it either done and
/// registered or not begun.
pub fn lock() -> MutexGuard<'static, Undo> {
    UNDO.lock().unwrap_or_else(|p| p.into_inner())
}

impl Undo {
    /// A process group to kill.
    pub fn add_group(&mut self, g: Pid) {
        self.groups.push(g);
    }

    pub fn remove_group(&mut self, g: Pid) {
        self.groups.retain(|&x| x != g);
    }

    /// A command to run (its failure ignored), after the process groups are killed; the
    /// commands run in the reverse order of their registration.
    pub fn add_command(&mut self, c: Command) {
        self.commands.push(c);
    }

    pub fn remove_command(&mut self, c: &[String]) {
        self.commands.retain(|x| x != c);
    }

    /// A directory to remove, last.
    pub fn add_dir(&mut self, d: PathBuf) {
        self.dirs.push(d);
    }

    pub fn remove_dir(&mut self, d: &Path) {
        self.dirs.retain(|x| x != d);
    }
}

/// From now on, SIGINT or SIGTERM kills every registered process group, runs the registered
/// commands, removes the registered directories and exits with 130.
pub fn on_signal() -> Result<()> {
    let rt = rserpool::util::runtime()?;
    // Watched from here on, before anything is started.
    let mut signals = rt.block_on(async { rserpool::util::Shutdown::watch() })?;
    std::thread::spawn(move || {
        rt.block_on(signals.recv());
        let u = lock();
        for &g in &u.groups {
            let _ = kill_process_group(g, Signal::KILL);
        }
        for c in u.commands.iter().rev() {
            run(c);
        }
        // Give the killed processes a moment to let go of their files.
        std::thread::sleep(Duration::from_millis(200));
        for d in &u.dirs {
            let _ = std::fs::remove_dir_all(d);
        }
        eprintln!("interrupted: processes stopped, temporary files removed, system changes undone");
        std::process::exit(130);
    });
    Ok(())
}

/// A directory removed when dropped, or on interruption.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(dir: PathBuf) -> TempDir {
        lock().add_dir(dir.clone());
        TempDir(dir)
    }

    pub fn path(&self) -> &std::path::Path {
        &self.0
    }

    /// Leaves the directory in place (to be read after a failed run).
    pub fn keep(self) -> PathBuf {
        lock().remove_dir(&self.0);
        let dir = self.0.clone();
        std::mem::forget(self);
        dir
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        lock().remove_dir(&self.0);
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
