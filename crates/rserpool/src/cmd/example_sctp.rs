//! `rserpool example echo|discard|daytime --listen sctp+udp://ADDR` (or `sctp://`): the example
//! services over SCTP, as rsplib's `rspserver` serves them, so that rsplib's pool user
//! (`rspterminal`) is served by an rserpool PE. The PE registers an SCTP transport; each message
//! of a pool user's association is answered on the same stream with the same payload protocol
//! identifier. ASAP messages from the pool user (PPID 11: cookies, business cards) are not
//! used by these stateless services and are ignored.

use super::example::Service;
use crate::PeOpts;
use anyhow::{Context, Result, bail};
use rserpool_asap::PoolElement;
use rserpool_asap::sctp::Association;
use rserpool_wire::{ASAP_PPID, Address};
use std::net::SocketAddr;
use tracing::{debug, info};

/// Runs `service` over SCTP at `listen` as a PE until a shutdown signal.
pub fn run(service: Service, listen: Address, opts: PeOpts) -> Result<()> {
    if !matches!(service, Service::Echo | Service::Discard | Service::Daytime) {
        bail!("{service:?} runs over TCP only; over SCTP: echo, discard or daytime");
    }
    if listen.addr.port() == 0 || listen.addr.ip().is_unspecified() {
        bail!(
            "--listen {listen}: give the address and port pool users reach (it is registered as is)"
        );
    }
    super::init_logging();
    super::runtime()?.block_on(async move {
        let (host, _) = rserpool_asap::sctp::host_for(&listen)
            .with_context(|| format!("cannot listen on {listen}"))?;
        let mut accepted = host
            .listen(listen.addr.port())
            .with_context(|| format!("cannot listen on {listen}"))?;
        let mut cfg = super::pe_config(&opts, listen.addr)?;
        cfg.service_over_sctp = true;
        let pe = PoolElement::start(cfg)?;
        super::report_status(&pe, &opts, listen.addr);
        info!(
            "{service:?} service at {listen} is PE {:#010x} of pool {}",
            pe.id(),
            opts.pool
        );
        let serve = async {
            while let Some(a) = accepted.recv().await {
                tokio::spawn(serve_one(service, a));
            }
        };
        tokio::select! {
            () = serve => {}
            () = super::shutdown_signal() => {}
        }
        pe.stop().await;
        super::sctp_settle().await;
        Ok(())
    })
}

async fn serve_one(service: Service, mut a: Association) {
    let peer: SocketAddr = a.peer();
    debug!("association from {peer}");
    if service == Service::Daytime {
        let _ = a.send(0, 0, super::example::daytime().into_bytes().into());
        return; // Dropping the handle shuts the association down once the line is acknowledged.
    }
    while let Some(m) = a.recv().await {
        if m.ppid == ASAP_PPID || service == Service::Discard {
            continue;
        }
        if a.send(m.stream, m.ppid, m.data).is_err() {
            break;
        }
    }
    debug!("association from {peer} ended");
}
