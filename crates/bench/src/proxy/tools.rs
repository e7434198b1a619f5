//! The outside tools a run needs (wrk, HAProxy, nginx with its stream module, tc, a raw
//! socket), checked before minutes of measuring, and their versions for the report.

use super::args::{Part, ProxyBenchArgs};
use super::config::STREAM_MODULE;
use super::synwatch::raw_socket;
use anyhow::{Result, bail};
use std::path::Path;
use std::process::Command;

/// What to install on Debian for everything the benchmark runs.
const INSTALL: &str =
    "apt-get install -y wrk haproxy nginx libnginx-mod-stream iproute2 nghttp2-client";

/// Everything a run will need, checked before minutes of measuring.
pub(super) fn check(args: &ProxyBenchArgs) -> Result<()> {
    let mut tools = vec!["wrk", "haproxy", "nginx"];
    if args.parts.iter().any(|p| p.is_h2()) {
        tools.push("h2load");
    }
    if args.parts.contains(&Part::Bulk) && args.link_mbit > 0 {
        tools.push("tc");
    }
    for tool in tools {
        let found = std::env::var_os("PATH")
            .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()));
        if !found {
            bail!("`{tool}` is not installed; the proxy benchmark needs: {INSTALL}");
        }
    }
    if !Path::new(STREAM_MODULE).is_file() {
        bail!("nginx's stream module is missing ({STREAM_MODULE}); install: {INSTALL}");
    }
    if args.parts.contains(&Part::Failover) {
        raw_socket()?;
    }
    Ok(())
}

pub(super) fn versions() -> String {
    let first_line = |cmd: &str, arg: &str| {
        Command::new(cmd)
            .arg(arg)
            .output()
            .ok()
            .map(|o| {
                let text = [o.stdout, o.stderr].concat();
                String::from_utf8_lossy(&text)
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .trim()
                    .to_string()
            })
            .unwrap_or_default()
    };
    let mut v = format!(
        "{}; {}; {}",
        first_line("haproxy", "-v"),
        first_line("nginx", "-v"),
        first_line("wrk", "-v")
    );
    let h2load = first_line("h2load", "--version");
    if !h2load.is_empty() {
        v += &format!("; {h2load}");
    }
    v
}
