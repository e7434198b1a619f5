//! Draining a pool element from the command line: the PE (`example` or `serve` with
//! `--control PATH`) listens on a Unix socket (mode 0600, so only its own user on its own host
//! may ask), and `rserpool drain SOCKET` makes it deregister (ASAP DEREGISTRATION) while it
//! goes on serving what reaches it; `rserpool undrain SOCKET` registers it again (`serve`: once
//! its target is healthy). Pool users and proxies subscribed to the pool learn it
//! with the registrar's next push. HAProxy's `set server … state drain` for RSerPool.
//!
//! From another host, `--control-tls ADDR` takes the same lines over TLS with mutual
//! authentication (RFC 5355's files, `--tls-cert/--tls-key/--tls-ca`): only a client with a
//! certificate from the CA may ask (`rserpool drain tls://ADDR --tls-cert … `).

use anyhow::{Context, Result, bail};
use clap::Args;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpStream, UnixListener, UnixStream};
use tracing::{info, warn};

#[derive(Args, Debug, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct DrainArgs {
    /// The PE's control socket: a path (`rserpool example|serve … --control PATH`), or
    /// `tls://ADDR` (`--control-tls ADDR`, with this client's TLS files).
    pub socket: PathBuf,
    /// This client's certificate, for `tls://ADDR`.
    #[arg(long, value_name = "FILE", requires_all = ["tls_key", "tls_ca"])]
    pub tls_cert: Option<PathBuf>,
    #[arg(long, value_name = "FILE", requires_all = ["tls_cert", "tls_ca"])]
    pub tls_key: Option<PathBuf>,
    /// The CA the PE's certificate must come from.
    #[arg(long, value_name = "FILE", requires_all = ["tls_cert", "tls_key"])]
    pub tls_ca: Option<PathBuf>,
}

/// Where a PE (`example`, `serve`) takes `rserpool drain` and `undrain`.
#[derive(Args, Debug, Clone, Default, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct ControlOpts {
    /// A Unix socket (mode 0600) on which `rserpool drain` / `undrain` take the PE out of its
    /// pool and back.
    #[arg(long, value_name = "PATH")]
    pub control: Option<PathBuf>,
    /// The same over TLS on ADDR, for clients with a certificate from the CA of `--tls-ca`
    /// (the PE's `--tls-cert` and `--tls-key` serve it).
    #[arg(long, value_name = "ADDR")]
    pub control_tls: Option<SocketAddr>,
}

impl ControlOpts {
    /// Starts what is asked for; `drained` is told each command (true: drain).
    pub async fn listen(
        &self,
        tls: Option<Arc<rserpool_tls::Tls>>,
        drained: impl Fn(bool) + Send + Sync + 'static,
    ) -> Result<()> {
        let drained = Arc::new(drained);
        if let Some(path) = &self.control {
            let d = drained.clone();
            listen(path, move |x| d(x))?;
        }
        if let Some(addr) = self.control_tls {
            let tls = tls.ok_or_else(|| {
                anyhow::anyhow!("--control-tls needs --tls-cert, --tls-key and --tls-ca")
            })?;
            listen_tls(addr, tls, move |x| drained(x)).await?;
        }
        Ok(())
    }

    /// Removes the Unix socket's file (at exit).
    pub fn remove(&self) {
        if let Some(path) = &self.control {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Time for a remote control client's TLS handshake and its one line.
const REMOTE_TIMEOUT: Duration = Duration::from_secs(5);

/// Takes `drain` and `undrain` lines over TLS on `addr` from clients with a certificate from
/// `tls`'s CA, for as long as the runtime runs.
async fn listen_tls(
    addr: SocketAddr,
    tls: Arc<rserpool_tls::Tls>,
    drained: impl Fn(bool) + Send + Sync + 'static,
) -> Result<()> {
    let drained = Arc::new(drained);
    let l = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("control listener {addr}"))?;
    info!("control: drain and undrain over TLS on {addr} (client certificates from the CA)");
    tokio::spawn(async move {
        while let Ok((s, peer)) = l.accept().await {
            let (drained, tls) = (drained.clone(), tls.clone());
            tokio::spawn(async move {
                let served = tokio::time::timeout(REMOTE_TIMEOUT, async {
                    let s = tls.accept_stream(true, s).await?;
                    answer(s, &*drained).await
                })
                .await;
                match served {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => warn!("control: {peer}: {e}"),
                    Err(_) => warn!("control: {peer}: nothing within {REMOTE_TIMEOUT:?}"),
                }
            });
        }
    });
    Ok(())
}

/// Listens on `path` for `drain` and `undrain` lines, for as long as the runtime runs, and
/// tells `drained` each (true: drain). A stale socket file is replaced; the new one is readable
/// and writable by its owner only.
fn listen(path: &Path, drained: impl Fn(bool) + Send + Sync + 'static) -> Result<()> {
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

async fn answer(
    s: impl AsyncRead + AsyncWrite,
    drained: &(dyn Fn(bool) + Send + Sync),
) -> std::io::Result<()> {
    let (rd, mut wr) = tokio::io::split(s);
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
        let line: &[u8] = if on { b"drain\n" } else { b"undrain\n" };
        let target = args.socket.to_string_lossy().into_owned();
        let reply = match target.strip_prefix("tls://") {
            Some(addr) => {
                let addr: SocketAddr = addr
                    .parse()
                    .with_context(|| format!("{target}: not tls://IP:PORT"))?;
                let files = match (&args.tls_cert, &args.tls_key, &args.tls_ca) {
                    (Some(cert), Some(key), Some(ca)) => rserpool_tls::TlsFiles {
                        cert: cert.clone(),
                        key: key.clone(),
                        ca: ca.clone(),
                    },
                    _ => bail!("{target} needs --tls-cert, --tls-key and --tls-ca"),
                };
                let tls = rserpool_tls::Tls::load(&files)?;
                let tcp = TcpStream::connect(addr)
                    .await
                    .with_context(|| format!("no PE listens on {addr}"))?;
                let s = tls
                    .connect_stream(addr.ip(), tcp)
                    .await
                    .with_context(|| format!("TLS with {addr}"))?;
                ask(s, line).await?
            }
            None => {
                let s = UnixStream::connect(&args.socket)
                    .await
                    .with_context(|| format!("no PE listens on {}", args.socket.display()))?;
                ask(s, line).await?
            }
        };
        let reply = reply.trim();
        if reply != if on { "drained" } else { "undrained" } {
            bail!("the PE answered {reply:?}");
        }
        println!("{reply}");
        Ok(())
    })
}

/// Sends `line` and returns the answer's line.
async fn ask(s: impl AsyncRead + AsyncWrite, line: &[u8]) -> Result<String> {
    let (rd, mut wr) = tokio::io::split(s);
    wr.write_all(line).await?;
    wr.flush().await?;
    let mut reply = String::new();
    BufReader::new(rd).read_line(&mut reply).await?;
    Ok(reply)
}
