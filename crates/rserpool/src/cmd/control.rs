//! Draining a pool element from the command line: the PE (`example` or `serve` with
//! `--control PATH`) listens on a Unix socket (mode 0600, so only its own user on its own host
//! may ask), and `rserpool drain SOCKET` makes it deregister (ASAP DEREGISTRATION) while it
//! goes on serving what reaches it; `rserpool undrain SOCKET` registers it again (`serve`: once
//! its target is healthy). Pool users and proxies subscribed to the pool learn it
//! with the registrar's next push. HAProxy's `set server … state drain` for RSerPool.

use anyhow::{Context, Result, bail};
use clap::Args;
use std::path::{Path, PathBuf};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tracing::{info, warn};

#[derive(Args, Debug, serde::Serialize)]
pub struct DrainArgs {
    /// The PE's control socket (`rserpool example|serve … --control PATH`).
    pub socket: PathBuf,
}

/// Listens on `path` for `drain` and `undrain` lines, for as long as the runtime runs, and
/// tells `drained` each (true: drain). A stale socket file is replaced; the new one is readable
/// and writable by its owner only.
pub fn listen(path: &Path, drained: impl Fn(bool) + Send + Sync + 'static) -> Result<()> {
    let drained = std::sync::Arc::new(drained);
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::remove_file(path);
    let l =
        UnixListener::bind(path).with_context(|| format!("control socket {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let drained = drained.clone();
            tokio::spawn(async move {
                if let Err(e) = answer(s, &*drained).await {
                    warn!("control: {e}");
                }
            });
        }
    });
    Ok(())
}

async fn answer(s: UnixStream, drained: &(dyn Fn(bool) + Send + Sync)) -> std::io::Result<()> {
    let (rd, mut wr) = s.into_split();
    let mut line = String::new();
    BufReader::new(rd).read_line(&mut line).await?;
    let reply = match line.trim() {
        "drain" => {
            info!("control: draining: deregistering, still serving what arrives");
            drained(true);
            "drained\n"
        }
        "undrain" => {
            info!("control: undrained: registering again");
            drained(false);
            "undrained\n"
        }
        _ => "unknown command (drain, undrain)\n",
    };
    wr.write_all(reply.as_bytes()).await
}

/// `rserpool drain` (`on`) and `rserpool undrain`.
pub fn run(args: DrainArgs, on: bool) -> Result<()> {
    super::runtime()?.block_on(async move {
        let mut s = UnixStream::connect(&args.socket)
            .await
            .with_context(|| format!("no PE listens on {}", args.socket.display()))?;
        s.write_all(if on { b"drain\n" } else { b"undrain\n" })
            .await?;
        let mut reply = String::new();
        BufReader::new(s).read_line(&mut reply).await?;
        let reply = reply.trim();
        if reply != if on { "drained" } else { "undrained" } {
            bail!("the PE answered {reply:?}");
        }
        println!("{reply}");
        Ok(())
    })
}
