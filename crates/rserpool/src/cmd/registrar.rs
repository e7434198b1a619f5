//! `rserpool registrar`: settings from `--config FILE` (TOML), then flags on top.

use anyhow::{Context, Result};
use clap::Args;
use rserpool_registrar::{Config, ConfigFlags, Server};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct RegistrarArgs {
    /// TOML file with settings (keys as the flags, e.g. `keep-alive-interval-ms = 5000`).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
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
    let cfg = load_config(&args)?;
    super::init_logging();
    let server = Server::bind(cfg)?;
    let stop = server.stop_handle();
    let rt = super::runtime()?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            rt.block_on(super::shutdown_signal());
            stop.stop();
        })
        .context("cannot start the signal thread")?;
    server.run()?;
    Ok(())
}
