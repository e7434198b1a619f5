//! Pool user commands: `resolve`, `connect`, and `status` (the registrar's handlespace).

use crate::RegistrarOpts;
use anyhow::{Result, bail};
use clap::Args;
use rserpool_asap::PoolUser;
use rserpool_wire::PoolHandle;
use serde::Serialize;
use std::net::SocketAddr;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Args, Debug, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct ResolveArgs {
    /// Pool handle.
    pub pool: String,
    /// Number of PEs to ask for (Handle Resolution Option); default: the registrar's choice.
    #[arg(long)]
    pub items: Option<u32>,
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub registrars: RegistrarOpts,
}

#[derive(Serialize)]
struct ResolvedPe {
    id: u32,
    transport: String,
    policy: String,
    home_registrar: u32,
}

#[derive(Serialize)]
struct Resolved {
    pool: String,
    policy: Option<String>,
    registrar: Option<String>,
    pool_elements: Vec<ResolvedPe>,
}

pub fn resolve(args: ResolveArgs) -> Result<()> {
    let mut cfg = super::pu_config(&args.registrars)?;
    cfg.items = args.items;
    let handle = PoolHandle::from(args.pool.as_str());
    let res = super::runtime()?
        .block_on(async move {
            let mut pu = PoolUser::new(cfg)?;
            let r = pu.resolve(&handle).await;
            drop(pu);
            super::sctp_settle().await;
            r
        })
        .map_err(|e| super::tls_hint(e, &args.registrars))?;
    let out = Resolved {
        pool: res.pool_handle.to_string(),
        policy: res.policy.as_ref().map(|p| p.short_name().to_string()),
        registrar: res.registrar.map(|r| r.to_string()),
        pool_elements: res
            .pool_elements
            .iter()
            .map(|pe| ResolvedPe {
                id: pe.id,
                transport: pe.user_transport.to_string(),
                policy: pe.policy.to_string(),
                home_registrar: pe.home_registrar,
            })
            .collect(),
    };
    if args.json {
        println!("{}", serde_json::to_string(&out)?);
        return Ok(());
    }
    println!(
        "pool {} ({}), answered by registrar {}",
        out.pool,
        out.policy.as_deref().unwrap_or("?"),
        out.registrar.as_deref().unwrap_or("cache")
    );
    println!("{:<12} {:<28} {:<26} home", "PE", "transport", "policy");
    for pe in &out.pool_elements {
        println!(
            "{:<12} {:<28} {:<26} {:#010x}",
            format!("{:#010x}", pe.id),
            pe.transport,
            pe.policy,
            pe.home_registrar
        );
    }
    Ok(())
}

#[derive(Args, Debug, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct ConnectArgs {
    /// Pool handle.
    pub pool: String,
    #[command(flatten)]
    pub registrars: RegistrarOpts,
}

pub fn connect(args: ConnectArgs) -> Result<()> {
    super::init_logging();
    let cfg = super::pu_config(&args.registrars)?;
    let handle = PoolHandle::from(args.pool.as_str());
    super::runtime()?.block_on(async move {
        let mut pu = PoolUser::new(cfg)?;
        let connected = pu.connect(&handle).await;
        // The registrar association is needed no more: the data flows, or it failed.
        drop(pu);
        let (stream, pe) = match connected {
            Ok(c) => c,
            Err(e) => {
                super::sctp_settle().await;
                return Err(super::tls_hint(e, &args.registrars));
            }
        };
        tracing::info!("connected to PE {:#010x} at {}", pe.id, stream.peer_addr()?);
        let (mut rd, mut wr) = stream.into_split();
        let upload = async {
            let mut stdin = tokio::io::stdin();
            let mut buf = vec![0u8; 16 * 1024];
            loop {
                let n = stdin.read(&mut buf).await?;
                if n == 0 {
                    break;
                }
                wr.write_all(&buf[..n]).await?;
            }
            wr.shutdown().await?;
            Ok::<_, std::io::Error>(())
        };
        let download = async {
            let mut stdout = tokio::io::stdout();
            tokio::io::copy(&mut rd, &mut stdout).await?;
            stdout.flush().await?;
            Ok::<_, std::io::Error>(())
        };
        let (u, d) = tokio::join!(upload, download);
        super::sctp_settle().await;
        d?;
        u.or_else(|e| {
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                Ok(())
            } else {
                Err(e)
            }
        })?;
        Ok(())
    })
}

#[derive(Args, Debug, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct StatusArgs {
    #[arg(long)]
    pub json: bool,
    /// A registrar's status listener (its `status` setting; repeatable, the first that
    /// answers is shown).
    #[arg(long = "status", value_name = "ADDR", default_values_t = [rserpool_registrar::DEFAULT_STATUS])]
    pub status: Vec<SocketAddr>,
    /// Status is no longer read from the ASAP port; this only says where it is now.
    #[arg(long = "registrar", value_name = "ADDR", hide = true)]
    pub registrar: Vec<SocketAddr>,
}

pub fn status(args: StatusArgs) -> Result<()> {
    if let Some(asap) = args.registrar.first() {
        bail!(
            "a registrar serves its status on a listener of its own, not on its ASAP port \
             {asap}: `rserpool status --status ADDR` with the registrar's `status` setting \
             (default {})",
            rserpool_registrar::DEFAULT_STATUS
        );
    }
    let st = super::runtime()?.block_on(rserpool::util::registrar_status(&args.status))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&st)?);
        return Ok(());
    }
    println!(
        "registrar {:#010x}: up {:.1} s, {} connections, {} pools, {} pool elements",
        st.server_id,
        st.uptime_ms as f64 / 1000.0,
        st.connections,
        st.pools.len(),
        st.pool_elements
    );
    if !st.peers.is_empty() {
        println!(
            "\nENRP peers ({} updates sent, {} received, {} audits, {} takeovers of {} PEs)",
            st.enrp.updates_sent,
            st.enrp.updates_received,
            st.enrp.audits,
            st.enrp.takeovers,
            st.enrp.pes_taken_over
        );
        println!(
            "  {:<12} {:<22} {:>10} {:<12} {:>5}  checksum",
            "ID", "address", "heard", "state", "PEs"
        );
        for p in &st.peers {
            let checksum = match (p.checksum, p.checksum_agrees) {
                (Some(c), Some(true)) => format!("{c:#06x} agrees"),
                (Some(c), _) => format!("{c:#06x} differs (audit)"),
                (None, _) => "-".to_string(),
            };
            println!(
                "  {:<12} {:<22} {:>9.1}s {:<12} {:>5}  {checksum}",
                format!("{:#010x}", p.id),
                p.address,
                p.ms_since_heard as f64 / 1000.0,
                p.state,
                p.pes_owned
            );
        }
    }
    for pool in &st.pools {
        println!(
            "\npool {} ({}), {} PEs",
            pool.handle,
            pool.policy,
            pool.pes.len()
        );
        println!(
            "  {:<12} {:<24} {:<26} {:<12} {:>10} {:>8}  asap",
            "PE", "transport", "policy", "home", "heard", "reports"
        );
        for pe in &pool.pes {
            println!(
                "  {:<12} {:<24} {:<26} {:<12} {:>9.1}s {:>8}  {}",
                format!("{:#010x}", pe.id),
                pe.transport,
                pe.policy,
                format!("{:#010x}", pe.home_registrar),
                pe.ms_since_heard as f64 / 1000.0,
                pe.unreachable_reports,
                pe.asap_transport.as_deref().unwrap_or("-")
            );
        }
    }
    Ok(())
}
