//! Where the `rserpool` binary is. The benchmarks measure the product as users run it, in
//! separate processes (`rserpool registrar`, `rserpool serve`, `rserpool proxy`).
//!
//! By default it is the `rserpool` next to this executable: cargo puts both into the same
//! target directory. Started by `cargo run`, the benchmark first has the same cargo build it
//! with this executable's profile (a no-op when it is up to date), so that a run never measures
//! a stale binary. `--rserpool PATH` names another binary and skips the build.

use anyhow::{Context, Result, anyhow, bail};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The `rserpool` binary to measure: `given`, or the one next to this executable.
pub fn locate(given: Option<PathBuf>) -> Result<PathBuf> {
    if let Some(path) = given {
        if !path.is_file() {
            bail!("--rserpool {}: no such file", path.display());
        }
        return Ok(path);
    }
    let exe = std::env::current_exe().context("finding own executable")?;
    let dir = exe
        .parent()
        .ok_or_else(|| anyhow!("{} has no directory", exe.display()))?;
    if let Some(cargo) = std::env::var_os("CARGO") {
        build(&cargo, dir)?;
    }
    let path = dir.join("rserpool");
    if !path.is_file() {
        bail!(
            "{} is missing: build it with `cargo build --release -p rserpool`, or name one \
             with --rserpool PATH",
            path.display()
        );
    }
    Ok(path)
}

/// `cargo build -p rserpool` into `dir`, which is `<target dir>/<profile>`.
fn build(cargo: &OsStr, dir: &Path) -> Result<()> {
    let (Some(profile), Some(target_dir)) = (dir.file_name().and_then(OsStr::to_str), dir.parent())
    else {
        return Ok(());
    };
    // Cargo names the dev profile's directory after its old name.
    let profile = if profile == "debug" { "dev" } else { profile };
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../Cargo.toml");
    let status = Command::new(cargo)
        .args([
            "build",
            "--profile",
            profile,
            "-p",
            "rserpool",
            "--bin",
            "rserpool",
        ])
        .arg("--manifest-path")
        .arg(&workspace)
        .arg("--target-dir")
        .arg(target_dir)
        .status()
        .context("running cargo to build rserpool")?;
    if !status.success() {
        bail!(
            "building rserpool failed ({status}); fix that, or name a binary with --rserpool PATH"
        );
    }
    Ok(())
}

/// A command running the `rserpool` at `bin`, logging warnings only.
pub fn command(bin: &Path) -> Command {
    let mut c = Command::new(bin);
    c.env("RUST_LOG", "warn");
    c
}

/// A registrar on free loopback ports, logging into `dir`, once it accepts: the process, its
/// ASAP address and its status address.
pub fn start_registrar(
    bin: &Path,
    dir: &Path,
) -> Result<(
    crate::process::Proc,
    std::net::SocketAddr,
    std::net::SocketAddr,
)> {
    start_registrar_with(bin, dir, &[])
}

/// [`start_registrar`] with `extra` flags.
pub fn start_registrar_with(
    bin: &Path,
    dir: &Path,
    extra: &[&str],
) -> Result<(
    crate::process::Proc,
    std::net::SocketAddr,
    std::net::SocketAddr,
)> {
    use crate::net::{free_port, local};
    let (reg, status) = (local(free_port()?), local(free_port()?));
    let p = crate::process::Proc::spawn(
        command(bin)
            .args(["registrar", "--asap", &reg.to_string()])
            .args(["--enrp", &local(free_port()?).to_string()])
            .args(["--status", &status.to_string()])
            .args(["--handover-socket", ""])
            .args(extra),
        &dir.join("registrar.log"),
    )?;
    crate::process::wait_for("the registrar", std::time::Duration::from_secs(5), || {
        std::net::TcpStream::connect(reg).is_ok()
    })?;
    Ok((p, reg, status))
}
