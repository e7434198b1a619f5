//! `rserpool split-splice`: a server of a proxy tier's pool answers the clients of its spliced
//! connections directly (docs/TIER.md, "Split splice"). Needs root and a build with clang.

use crate::RegistrarOpts;
use anyhow::{Result, anyhow};
use clap::Args;
use rserpool_proxy::tier::split::{SplitConfig, SplitServer};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args, Debug, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct SplitArgs {
    /// The proxy tier's pool handle (the proxies' `[tier] pool`).
    #[arg(long)]
    pub tier: String,
    /// This server's tier address: the proxies link to it and send it the splices.
    #[arg(long)]
    pub listen: SocketAddr,
    /// The interfaces the answers leave by (repeatable).
    #[arg(long = "interface", required = true)]
    pub interfaces: Vec<String>,
    /// Where the flow table is pinned.
    #[arg(long, default_value = "/sys/fs/bpf/rserpool-split")]
    pub pin_dir: PathBuf,
    #[arg(long, default_value_t = 65_536)]
    pub max_flows: u32,
    /// An answer direction without a packet for this long is removed.
    #[arg(long, default_value_t = 3_600_000)]
    pub idle_timeout_ms: u64,
    /// A direction closed by a FIN is removed once quiet this long.
    #[arg(long, default_value_t = 10_000)]
    pub fin_timeout_ms: u64,
    #[command(flatten)]
    pub registrars: RegistrarOpts,
}

pub fn run(args: SplitArgs) -> Result<()> {
    super::init_logging();
    super::runtime()?.block_on(async move {
        let _server = SplitServer::start(SplitConfig {
            tier: args.tier,
            listen: args.listen,
            registrar_tls: args.registrars.tls()?,
            registrars: args.registrars.registrars,
            interfaces: args.interfaces,
            pin_dir: args.pin_dir,
            max_flows: args.max_flows,
            idle_timeout: Duration::from_millis(args.idle_timeout_ms.max(1)),
            fin_timeout: Duration::from_millis(args.fin_timeout_ms.max(1)),
        })
        .await
        .map_err(|e| anyhow!(e))?;
        super::shutdown_signal().await;
        Ok(())
    })
}
