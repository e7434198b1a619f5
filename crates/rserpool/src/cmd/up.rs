//! `rserpool up`: the built-in default. A registrar on loopback and the EchoPool (three echo
//! PEs, least used) in one process; prints where everything listens and how to try it.

use super::example::{self, Service};
use crate::{PeOpts, RegistrarOpts};
use anyhow::{Context, Result};
use clap::Args;
use rserpool_registrar::{Config, RegistrarThread};
use std::net::SocketAddr;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct UpArgs {
    /// Registrar ASAP address.
    #[arg(long, default_value = "127.0.0.1:3863")]
    pub asap: SocketAddr,
    /// Pool handle of the example pool.
    #[arg(long, default_value = "EchoPool")]
    pub pool: String,
    /// Number of echo pool elements.
    #[arg(long, default_value_t = 3)]
    pub pes: usize,
}

pub fn run(args: UpArgs) -> Result<()> {
    super::init_logging();
    let cfg = Config {
        asap: args.asap,
        ..Config::default()
    };
    let registrar = RegistrarThread::start(cfg).with_context(|| {
        format!(
            "cannot start the registrar on {} (is another one running? choose another with --asap)",
            args.asap
        )
    })?;
    let asap = registrar.asap_addr();
    let rt = super::runtime()?;
    let result = rt.block_on(async {
        let opts = PeOpts {
            pool: args.pool.clone(),
            policy: "lu".into(),
            weight: 1,
            id: None,
            reregistration_interval_ms: 30_000,
            registrars: RegistrarOpts {
                registrars: vec![asap],
                announce_listen: None,
            },
        };
        let mut pes = Vec::new();
        for _ in 0..args.pes.max(1) {
            let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
            pes.push(example::start(Service::Echo, loopback, 100, &opts).await?);
        }
        for ex in &pes {
            ex.pe.wait_registered(Duration::from_secs(5)).await?;
        }
        let flag = if asap.port() == rserpool_wire::ASAP_PORT {
            String::new()
        } else {
            format!(" --registrar {asap}")
        };
        println!();
        println!(
            "rserpool {} is up. Registrar {:#010x} listens for ASAP on {asap} (TCP).",
            env!("CARGO_PKG_VERSION"),
            registrar.server_id()
        );
        println!(
            "Pool {} (least used) has {} echo pool elements:",
            args.pool,
            pes.len()
        );
        for ex in &pes {
            println!("  PE {:#010x} at {}", ex.pe.id(), ex.addr);
        }
        println!();
        println!("Try, in another terminal:");
        println!("  cargo run --release -- resolve {}{flag}", args.pool);
        println!("  cargo run --release -- status{flag}");
        println!(
            "  echo hello | cargo run --release -- connect {}{flag}",
            args.pool
        );
        println!("  curl http://{asap}/status");
        println!();
        println!("Ctrl-C stops everything.");
        super::shutdown_signal().await;
        println!("stopping: deregistering the pool elements");
        for ex in pes {
            ex.task.abort();
            ex.pe.stop().await;
        }
        Ok::<_, anyhow::Error>(())
    });
    registrar.stop();
    result
}
