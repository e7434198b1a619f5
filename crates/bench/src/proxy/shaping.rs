//! Rate limits on loopback with `tc`, so that bulk throughput can also be measured where the
//! network, not the CPU, is the limit (as on the seed paper's testbed). Registered in the undo
//! registry while in place.

use crate::process::run_tool;
use crate::undo;
use anyhow::{Context, Result, bail};
use std::net::SocketAddr;
use std::process::Command;

/// Rate limits on loopback for the download direction, one per hop: everything the backends
/// send shares one class, everything the proxy's TCP listener sends another, each at `mbit`.
/// Dropping it removes the qdisc.
pub(super) struct Links;

impl Links {
    pub(super) fn limit(mbit: u64, backends: &[SocketAddr], front: &[SocketAddr]) -> Result<Links> {
        let shown = Command::new("tc")
            .args(["qdisc", "show", "dev", "lo"])
            .output()
            .context("running tc")?;
        let shown = String::from_utf8_lossy(&shown.stdout);
        if shown
            .lines()
            .any(|l| !l.trim().is_empty() && !l.contains("noqueue"))
        {
            bail!(
                "lo already has a qdisc ({}); remove it or use --link-mbit 0",
                shown.trim()
            );
        }
        let rate = format!("{mbit}mbit");
        // Before: deleting a qdisc that was never added does no harm.
        undo::lock().add_command(unshape());
        if let Err(e) = tc(&[
            "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "1",
        ]) {
            undo::lock().remove_command(&unshape());
            return Err(e);
        }
        let links = Links;
        tc(&[
            "class", "add", "dev", "lo", "parent", "1:", "classid", "1:1", "htb", "rate", "100gbit",
        ])?;
        for class in ["1:2", "1:3"] {
            tc(&[
                "class", "add", "dev", "lo", "parent", "1:", "classid", class, "htb", "rate", &rate,
            ])?;
        }
        let hops = backends.iter().map(|b| (b, "1:2")).chain(
            front
                .iter()
                .filter(|f| !backends.contains(f))
                .map(|f| (f, "1:3")),
        );
        for (addr, class) in hops {
            tc(&[
                "filter",
                "add",
                "dev",
                "lo",
                "parent",
                "1:",
                "protocol",
                "ip",
                "prio",
                "1",
                "u32",
                "match",
                "ip",
                "sport",
                &addr.port().to_string(),
                "0xffff",
                "flowid",
                class,
            ])?;
        }
        Ok(links)
    }
}

impl Drop for Links {
    fn drop(&mut self) {
        let c = unshape();
        undo::lock().remove_command(&c);
        undo::run(&c);
    }
}

/// Removes every rate limit from lo.
fn unshape() -> undo::Command {
    undo::command(&["tc", "qdisc", "del", "dev", "lo", "root"])
}

fn tc(args: &[&str]) -> Result<()> {
    run_tool(
        "tc",
        args,
        "iproute2; --link-mbit 0 skips the rate-limited run",
    )
}
