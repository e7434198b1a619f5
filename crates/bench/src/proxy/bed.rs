//! The test bed every system shares: a registrar, three nginx backends serving files from
//! tmpfs, and an `rserpool serve` sidecar per backend that makes it a pool element.

use super::config;
use super::{BACKENDS, BULK, BULK_SIZE, GRPC_POOL, MB, POOL, SMALL, SMALL_SIZE};
use crate::net::{free_port, local, registrar_status};
use crate::process::{Proc, wait_for};
use crate::undo::TempDir;
use anyhow::Result;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// The shared test bed: a registrar, three nginx backends and their sidecars. Fields drop in
/// order: the processes go before their directory.
pub(crate) struct Bed {
    /// The rserpool binary: registrar, sidecars and the rserpool proxy.
    pub(crate) rserpool: PathBuf,
    /// The binary of the system `baseline`'s proxy, if it runs.
    pub(crate) baseline: Option<PathBuf>,
    pub(crate) dir: PathBuf,
    pub(crate) registrar: SocketAddr,
    /// The registrar's status listener.
    registrar_status: SocketAddr,
    pub(crate) backends: Vec<SocketAddr>,
    /// HTTP/2 backends answering gRPC-shaped calls (`rserpool-bench grpc-backend`), when the
    /// gRPC part runs.
    pub(super) grpc_backends: Vec<SocketAddr>,
    /// The certificate the proxies terminate HTTPS with.
    pub(super) tls: config::TlsFiles,
    backend_procs: Vec<Option<Proc>>,
    others: Vec<Proc>,
    _tmp: TempDir,
}

impl Bed {
    /// The back ends, for a proxy's configuration.
    pub(super) fn upstreams(&self) -> config::Upstreams<'_> {
        config::Upstreams {
            backends: &self.backends,
            grpc_backends: &self.grpc_backends,
        }
    }

    pub(crate) fn start(sizes: &[usize], rserpool: &Path, grpc: bool) -> Result<Bed> {
        // tmpfs, so that uploads cost memory copies, not disk writes.
        let dir = PathBuf::from(format!(
            "/dev/shm/rserpool-bench-proxy-{}",
            std::process::id()
        ));
        let www = dir.join("www");
        std::fs::create_dir_all(www.join("up"))?;
        let tmp = TempDir::new(dir.clone());
        std::fs::write(www.join(&SMALL[1..]), vec![b'x'; SMALL_SIZE])?;
        std::fs::write(www.join(&BULK[1..]), vec![0u8; BULK_SIZE])?;
        for &mib in sizes {
            std::fs::write(www.join(format!("m{mib}")), vec![0u8; mib * MB])?;
        }
        // nginx's workers may run as another user.
        use std::os::unix::fs::PermissionsExt;
        for d in [&dir, &www, &www.join("up")] {
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o777))?;
        }
        let tls = config::TlsFiles::make(&dir)?;
        let registrar = local(free_port()?);
        let registrar_status = local(free_port()?);
        let mut others = vec![Proc::spawn(
            Command::new(rserpool)
                .args(["registrar", "--asap", &registrar.to_string()])
                .args(["--enrp", &local(free_port()?).to_string()])
                .args(["--status", &registrar_status.to_string()])
                .env("RUST_LOG", "warn"),
            &dir.join("registrar.log"),
        )?];
        wait_for("the registrar", Duration::from_secs(5), || {
            std::net::TcpStream::connect(registrar).is_ok()
        })?;
        let mut bed = Bed {
            rserpool: rserpool.to_path_buf(),
            baseline: None,
            dir,
            registrar,
            registrar_status,
            backends: Vec::new(),
            grpc_backends: Vec::new(),
            tls,
            backend_procs: Vec::new(),
            others: Vec::new(),
            _tmp: tmp,
        };
        for i in 0..BACKENDS {
            let addr = local(free_port()?);
            bed.backends.push(addr);
            bed.backend_procs.push(None);
            bed.start_backend(i)?;
            // The sidecar checks the second address, so its checks are not counted as
            // connection attempts in the failover run.
            others.push(Proc::spawn(
                Command::new(rserpool)
                    .args(["serve", "--target", &check_addr(addr).to_string()])
                    .args(["--advertise", &addr.to_string()])
                    .args(["--pool", POOL, "--id", &(i + 1).to_string()])
                    .args(["--registrar", &registrar.to_string()])
                    .env("RUST_LOG", "warn"),
                &bed.dir.join(format!("sidecar{i}.log")),
            )?);
        }
        for i in 0..if grpc { BACKENDS } else { 0 } {
            let addr = local(free_port()?);
            bed.grpc_backends.push(addr);
            others.push(Proc::spawn(
                Command::new(std::env::current_exe()?)
                    .args(["grpc-backend", "--listen", &addr.to_string()])
                    .args(["--listen", &check_addr(addr).to_string()]),
                &bed.dir.join(format!("grpc{i}.log")),
            )?);
            wait_for("a gRPC backend", Duration::from_secs(5), || {
                std::net::TcpStream::connect(addr).is_ok()
            })?;
            others.push(Proc::spawn(
                Command::new(rserpool)
                    .args(["serve", "--target", &check_addr(addr).to_string()])
                    .args(["--advertise", &addr.to_string()])
                    .args(["--pool", GRPC_POOL, "--id", &(100 + i).to_string()])
                    .args(["--registrar", &registrar.to_string()])
                    .env("RUST_LOG", "warn"),
                &bed.dir.join(format!("grpc-sidecar{i}.log")),
            )?);
        }
        bed.others = others;
        bed.wait_registered()?;
        Ok(bed)
    }

    pub(super) fn start_backend(&mut self, i: usize) -> Result<()> {
        let addr = self.backends[i];
        let conf = config::nginx_backend(i, addr, check_addr(addr), &self.dir);
        let path = self.dir.join(format!("b{i}.conf"));
        std::fs::write(&path, conf)?;
        self.backend_procs[i] = None;
        let p = Proc::spawn(
            Command::new("nginx")
                .arg("-e")
                .arg(self.dir.join(format!("b{i}.err")))
                .arg("-c")
                .arg(&path),
            &self.dir.join(format!("b{i}.log")),
        )?;
        self.backend_procs[i] = Some(p);
        wait_for("an nginx backend", Duration::from_secs(5), || {
            std::net::TcpStream::connect(addr).is_ok()
        })
    }

    pub(super) fn wait_registered(&self) -> Result<()> {
        wait_for(
            "the backends' registrations",
            Duration::from_secs(15),
            || {
                registrar_status(self.registrar_status).is_ok_and(|s| {
                    s.pool_elements == self.backends.len() + self.grpc_backends.len()
                })
            },
        )
    }

    /// Every PUT run finds an empty upload directory and allocates its tmpfs pages afresh.
    pub(super) fn clear_uploads(&self) -> Result<()> {
        for e in std::fs::read_dir(self.dir.join("www/up"))? {
            std::fs::remove_file(e?.path())?;
        }
        Ok(())
    }

    pub(super) fn kill_backend(&mut self, i: usize) {
        if let Some(mut p) = self.backend_procs[i].take() {
            p.kill();
        }
    }
}

/// The address the sidecar checks: same port on 127.0.0.2.
fn check_addr(a: SocketAddr) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::new(127, 0, 0, 2), a.port()))
}
