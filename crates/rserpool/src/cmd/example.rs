//! `rserpool example`: small TCP services that register themselves as pool elements through the
//! library, like rsplib's rspserver services. For adaptive policies each reports its load as
//! active connections / capacity whenever a connection opens or closes.

use crate::PeOpts;
use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use rserpool_asap::PoolElement;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, info};

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum Service {
    /// RFC 862: send back what arrives.
    Echo,
    /// RFC 863: read and drop.
    Discard,
    /// RFC 867: one line with the date and time, then close.
    Daytime,
    /// RFC 864: an endless rotating character pattern.
    Chargen,
}

#[derive(Args, Debug)]
pub struct ExampleArgs {
    pub service: Service,
    /// Listening address of the service (port 0 = any free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// Connections at which the reported load is 100%.
    #[arg(long, default_value_t = 100)]
    pub capacity: usize,
    #[command(flatten)]
    pub pe: PeOpts,
}

pub fn run(args: ExampleArgs) -> Result<()> {
    super::init_logging();
    super::runtime()?.block_on(async move {
        let ex = start(args.service, args.listen, args.capacity, &args.pe).await?;
        info!(
            "{:?} service at {} is PE {:#010x} of pool {}",
            args.service,
            ex.addr,
            ex.pe.id(),
            args.pe.pool
        );
        super::shutdown_signal().await;
        ex.pe.stop().await;
        Ok(())
    })
}

/// A running example service and its registration.
pub struct Example {
    pub addr: SocketAddr,
    pub pe: PoolElement,
    pub task: tokio::task::JoinHandle<()>,
}

/// Binds the service, starts its PE and its accept loop (on the current runtime).
pub async fn start(
    service: Service,
    listen: SocketAddr,
    capacity: usize,
    opts: &PeOpts,
) -> Result<Example> {
    let listener = TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    let addr = listener.local_addr()?;
    let pe = PoolElement::start(super::pe_config(opts, addr)?)?;
    let adaptive = rserpool_wire::Policy::from_name(&opts.policy, opts.weight)
        .is_some_and(|p| p.is_adaptive());
    let load = Load {
        active: Arc::new(AtomicUsize::new(0)),
        capacity: capacity.max(1),
    };
    let reporter = pe_reporter(&pe, adaptive);
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, peer)) = listener.accept().await else {
                continue;
            };
            debug!("{service:?}: connection from {peer}");
            let load = load.clone();
            let reporter = reporter.clone();
            tokio::spawn(async move {
                load.change(1, &reporter);
                let _ = serve(service, stream).await;
                load.change(-1, &reporter);
            });
        }
    });
    Ok(Example { addr, pe, task })
}

/// Sends load updates to the PE from connection tasks.
type Reporter = Option<tokio::sync::mpsc::UnboundedSender<f64>>;

fn pe_reporter(pe: &PoolElement, adaptive: bool) -> Reporter {
    if !adaptive {
        return None;
    }
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<f64>();
    let updater = pe.updater();
    tokio::spawn(async move {
        while let Some(mut f) = rx.recv().await {
            while let Ok(newer) = rx.try_recv() {
                f = newer;
            }
            updater.update_load(f);
        }
    });
    Some(tx)
}

#[derive(Clone)]
struct Load {
    active: Arc<AtomicUsize>,
    capacity: usize,
}

impl Load {
    fn change(&self, delta: isize, reporter: &Reporter) {
        let n = if delta > 0 {
            self.active.fetch_add(1, Ordering::Relaxed) + 1
        } else {
            self.active
                .fetch_sub(1, Ordering::Relaxed)
                .saturating_sub(1)
        };
        if let Some(tx) = reporter {
            let _ = tx.send((n as f64 / self.capacity as f64).min(1.0));
        }
    }
}

async fn serve(service: Service, mut stream: TcpStream) -> std::io::Result<()> {
    match service {
        Service::Echo => {
            let (mut r, mut w) = stream.split();
            tokio::io::copy(&mut r, &mut w).await?;
        }
        Service::Discard => {
            let mut buf = vec![0u8; 16 * 1024];
            while stream.read(&mut buf).await? > 0 {}
        }
        Service::Daytime => {
            stream.write_all(daytime().as_bytes()).await?;
            stream.shutdown().await?;
        }
        Service::Chargen => {
            // Lines of 72 printable characters, each starting one further (RFC 864).
            let chars: Vec<u8> = (b' '..=b'~').collect();
            let mut start = 0usize;
            let mut block = Vec::with_capacity(74 * 64);
            loop {
                block.clear();
                for _ in 0..64 {
                    block.extend((0..72).map(|i| chars[(start + i) % chars.len()]));
                    block.extend_from_slice(b"\r\n");
                    start = (start + 1) % chars.len();
                }
                stream.write_all(&block).await?;
            }
        }
    }
    Ok(())
}

/// "2026-11-21 14:03:07 UTC\r\n" from the system clock.
fn daytime() -> String {
    let (y, m, d, secs) = crate::util::utc_now();
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC\r\n",
        secs / 3600,
        secs % 3600 / 60,
        secs % 60
    )
}
