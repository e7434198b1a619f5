//! What a long-running command (the proxy, the registrar) needs from its service manager for
//! upgrades without a gap: telling systemd it is ready and which process is now the service
//! (`sd_notify`, with `NotifyAccess=all`), and starting its successor on SIGUSR2.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use tracing::{info, warn};

/// Tells systemd `state` (`READY=1`, `MAINPID=…`) when it started this process as a
/// `Type=notify` service; does nothing otherwise. See sd_notify(3).
pub fn notify(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let sent = (|| -> std::io::Result<()> {
        use std::os::linux::net::SocketAddrExt;
        use std::os::unix::ffi::OsStrExt;
        let bytes = path.as_bytes();
        let addr = match bytes.strip_prefix(b"@") {
            Some(name) => std::os::unix::net::SocketAddr::from_abstract_name(name)?,
            None => std::os::unix::net::SocketAddr::from_pathname(PathBuf::from(&path))?,
        };
        let s = std::os::unix::net::UnixDatagram::unbound()?;
        s.send_to_addr(state.as_bytes(), &addr).map(drop)
    })();
    if let Err(e) = sent {
        warn!("cannot tell systemd \"{state}\": {e}");
    }
}

/// This process is the service now, and ready.
pub fn notify_ready() {
    notify(&format!("MAINPID={}\nREADY=1", std::process::id()));
}

/// The executable and arguments this process was started with, read at start: after a package
/// upgrade the path names the new binary.
pub struct Successor {
    exe: PathBuf,
    args: Vec<OsString>,
}

impl Successor {
    pub fn here() -> Option<Successor> {
        match std::env::current_exe() {
            Ok(exe) => Some(Successor {
                exe,
                args: std::env::args_os().skip(1).collect(),
            }),
            Err(e) => {
                warn!("cannot find this program's path, so SIGUSR2 cannot upgrade: {e}");
                None
            }
        }
    }

    /// Starts the successor (SIGUSR2): it takes the listening sockets over by the hand-over
    /// socket, and this process stops once it has. Its exit is logged.
    pub fn start(&self) {
        match std::process::Command::new(&self.exe)
            .args(&self.args)
            .spawn()
        {
            Ok(mut child) => {
                let pid = child.id();
                info!(
                    "started {} as process {pid} to take over",
                    self.exe.display()
                );
                std::thread::spawn(move || match child.wait() {
                    Ok(s) if s.success() => {}
                    Ok(s) => warn!("the successor {pid} ended: {s}"),
                    Err(e) => warn!("the successor {pid}: {e}"),
                });
            }
            Err(e) => warn!("cannot start {}: {e}", self.exe.display()),
        }
    }
}

/// Where a service's hand-over socket is (docs/OPERATIONS.md): `given` (a path or `@NAME`; `""`:
/// none), else the abstract name `@PREFIX:` and the configuration file's path, else `@PREFIX:`
/// and `addrs` (none when a port is left to the kernel: no successor could name the same one).
pub fn handover_address(
    prefix: &str,
    given: Option<&str>,
    config: Option<&Path>,
    addrs: &[SocketAddr],
) -> anyhow::Result<Option<rserpool_handover::Address>> {
    use rserpool_handover::Address;
    Ok(match (given, config) {
        (Some(""), _) => None,
        (Some(s), _) => Some(
            s.parse()
                .map_err(|e: String| anyhow::anyhow!("handover socket: {e}"))?,
        ),
        (None, Some(file)) => {
            let file = std::fs::canonicalize(file).unwrap_or_else(|_| file.to_path_buf());
            Some(Address::abstract_for(prefix, &file.display().to_string()))
        }
        (None, None) if addrs.iter().any(|a| a.port() == 0) => None,
        (None, None) => {
            let addrs: Vec<String> = addrs.iter().map(SocketAddr::to_string).collect();
            Some(Address::abstract_for(prefix, &addrs.join(",")))
        }
    })
}
