//! `rserpool registrar`: settings from `--config FILE` (TOML), then flags on top.

use anyhow::{Context, Result};
use clap::Args;
use rserpool_registrar::{Config, ConfigFlags, Inherited, Server};
use std::path::PathBuf;
use tracing::{info, warn};

#[derive(Args, Debug)]
pub struct RegistrarArgs {
    /// TOML file with settings (keys as the flags, e.g. `keep-alive-interval-ms = 5000`).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Where a new registrar process started with these settings takes this one over (its
    /// listeners, Server Identifier, PEs and associations): a path, or `@NAME` for an abstract
    /// Unix socket; `""` turns it off. Default: an abstract name made from the config file's
    /// path, or from the ASAP address (none when its port is left to the kernel).
    #[arg(long, value_name = "PATH|@NAME")]
    pub handover_socket: Option<String>,
    #[command(flatten)]
    pub flags: ConfigFlags,
}

pub fn load_config(args: &RegistrarArgs) -> Result<Config> {
    let mut cfg = match &args.config {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("cannot read {}", p.display()))?;
            Config::from_toml(&text).with_context(|| format!("bad settings in {}", p.display()))?
        }
        None => Config::default(),
    };
    args.flags.apply(&mut cfg);
    Ok(cfg)
}

pub fn run(args: RegistrarArgs) -> Result<()> {
    let mut cfg = load_config(&args)?;
    super::init_logging();
    cfg.max_connections = super::fit_to_open_files(
        cfg.max_connections,
        Config::default().max_connections,
        1,
        "max-connections",
    );
    // Signals are caught before the listeners open, as the proxy's are: a SIGTERM that
    // comes right after the registrar says it listens (a supervisor stopping it as it
    // starts) stops it, instead of falling between the start and a watch begun later.
    let rt = super::runtime()?;
    let (mut shutdown, mut usr2) = {
        let _in = rt.enter();
        let usr2 = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined2())
            .context("cannot watch SIGUSR2")?;
        (super::Shutdown::watch()?, usr2)
    };
    let at = handover_address(&args, &cfg)?;
    // A registrar running with these settings hands everything over: no PE registers again.
    let inherited = match at.as_ref().map(Inherited::take).transpose() {
        Ok(i) => i.flatten(),
        Err(e) => {
            warn!("no hand-over, binding afresh: {e}");
            None
        }
    };
    if let Some(i) = &inherited {
        info!("taking over from process {}", i.pid());
    }
    let xds = cfg.xds.map(xds_listener).transpose()?;
    let mut server = Server::bind_with(cfg, inherited)?;
    if let Some(a) = at.clone() {
        server.offer_handover(a);
    }
    if let Some(listener) = xds {
        let (mut publisher, snapshots) = rserpool_xds::publish::Publisher::channel();
        server.observe(Box::new(move |hs, serving| publisher.update(hs, serving)));
        let ads = rserpool_xds::ads::Ads::new(snapshots, rserpool_xds::ads::Limits::default());
        let (counters, open) = (ads.counters(), ads.clone());
        server.xds_counters(Box::new(move || {
            use std::sync::atomic::Ordering::Relaxed;
            rserpool_registrar::XdsCounters {
                streams_open: open.open_streams() as u64,
                streams_opened: counters.streams_opened.load(Relaxed),
                streams_refused: counters.streams_refused.load(Relaxed),
                responses: counters.responses.load(Relaxed),
                acks: counters.acks.load(Relaxed),
                nacks: counters.nacks.load(Relaxed),
                unknown_types: counters.unknown_types.load(Relaxed),
            }
        }));
        std::thread::Builder::new()
            .name("xds".into())
            .spawn(move || serve_xds(listener, ads))
            .context("cannot start the xDS thread")?;
    }
    let stop = server.stop_handle();
    let successor = super::service::Successor::here();
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            rt.block_on(async {
                loop {
                    tokio::select! {
                        () = shutdown.recv() => return,
                        _ = usr2.recv() => match (&successor, &at) {
                            (Some(s), Some(_)) => s.start(),
                            _ => warn!("SIGUSR2 ignored: no hand-over socket"),
                        },
                    }
                }
            });
            stop.stop();
        })
        .context("cannot start the signal thread")?;
    super::service::notify_ready();
    server.run()?;
    Ok(())
}

/// The xDS listener. `SO_REUSEPORT`: a registrar's successor (an upgrade) listens beside it
/// until it stops; the xDS clients' streams to the old process end then, and they open new
/// ones, which the successor answers from its own handlespace.
fn xds_listener(addr: std::net::SocketAddr) -> Result<std::net::TcpListener> {
    let bind = || -> std::io::Result<std::net::TcpListener> {
        let s = socket2::Socket::new(
            socket2::Domain::for_address(addr),
            socket2::Type::STREAM,
            None,
        )?;
        s.set_reuse_address(true)?;
        s.set_reuse_port(true)?;
        s.set_nonblocking(true)?;
        s.bind(&addr.into())?;
        s.listen(1024)?;
        Ok(s.into())
    };
    bind().with_context(|| format!("cannot listen for xDS on {addr}"))
}

fn serve_xds(listener: std::net::TcpListener, ads: rserpool_xds::ads::Ads) {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return warn!("xDS: no runtime: {e}"),
    };
    rt.block_on(async move {
        let addr = listener.local_addr().ok();
        let listener = match tokio::net::TcpListener::from_std(listener) {
            Ok(l) => l,
            Err(e) => return warn!("xDS: {e}"),
        };
        info!("xDS (ADS, state of the world and incremental) on {addr:?}");
        if let Err(e) = rserpool_xds::ads::serve(listener, ads).await {
            warn!("xDS server stopped: {e}");
        }
    });
}

/// Where this registrar's hand-over socket is (see `--handover-socket`); `None`: no hand-over.
fn handover_address(
    args: &RegistrarArgs,
    cfg: &Config,
) -> Result<Option<rserpool_handover::Address>> {
    super::service::handover_address(
        "rserpool-registrar",
        args.handover_socket.as_deref(),
        args.config.as_deref(),
        &cfg.asap.tcp().collect::<Vec<_>>(),
    )
}
