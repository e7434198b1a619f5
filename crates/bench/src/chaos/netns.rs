//! The soak's network: one network namespace per host on a bridge in this (the harness's)
//! namespace, and the two network faults the soak injects on a host's link — a cut
//! (`ip link set … down`) and packet loss (an nftables rule inside the host's namespace, since
//! this kernel has no netem). Names carry this process's ID, so that two runs do not meet, and
//! everything is registered in [`undo`] before it is made, so that Ctrl-C removes it too.

use crate::process::run_tool;
use crate::undo;
use anyhow::{Context, Result, bail};
use std::net::Ipv4Addr;
use std::process::Command;

/// One host: a namespace, the veth that links it to the bridge (seen from here) and its
/// address.
pub struct Host {
    /// Short name: r1, h3, front.
    pub name: String,
    pub netns: String,
    pub veth: String,
    pub ip: Ipv4Addr,
    /// The namespace the veth's other end is in, when it is not on the bridge here (the proxy
    /// tier's hosts hang on its router).
    pub behind: Option<String>,
}

/// The hosts on their bridge. Dropping it deletes the namespaces (with the processes' sockets,
/// veths and nftables tables in them) and the bridge.
pub struct Net {
    bridge: String,
    pub hosts: Vec<Host>,
    undo: Vec<undo::Command>,
}

/// What the soak needs from the system; an error says what is missing.
pub fn preflight() -> Result<()> {
    let mut missing = Vec::new();
    if !rustix::process::geteuid().is_root() {
        missing.push("root (network namespaces)".to_string());
    }
    for (tool, flag, package) in [("ip", "-V", "iproute2"), ("nft", "--version", "nftables")] {
        if Command::new(tool).arg(flag).output().is_err() {
            missing.push(format!("`{tool}` (apt-get install {package})"));
        }
    }
    if missing.is_empty() {
        Ok(())
    } else {
        bail!("the chaos soak needs {}", missing.join(", "))
    }
}

impl Net {
    /// Creates the bridge and one namespace per name, with addresses .1, .2, … of a /24 that
    /// no route here uses yet; the bridge (this namespace) is .254.
    pub fn create(names: &[&str]) -> Result<Net> {
        let tag = std::process::id();
        let subnet = free_subnet(tag)?;
        let mut net = Net {
            bridge: format!("rsc{tag}br"),
            hosts: Vec::new(),
            undo: Vec::new(),
        };
        let bridge = net.bridge.clone();
        net.made(&["ip", "link", "del", &bridge], || {
            ip(&["link", "add", &bridge, "type", "bridge"])
        })?;
        ip(&["addr", "add", &format!("{subnet}.254/24"), "dev", &bridge])?;
        ip(&["link", "set", &bridge, "up"])?;
        for (i, name) in names.iter().enumerate() {
            let host = Host {
                name: name.to_string(),
                netns: netns_name(name),
                veth: format!("rsc{tag}h{i}"),
                ip: format!("{subnet}.{}", i + 1).parse()?,
                behind: None,
            };
            let ns = host.netns.clone();
            net.made(&["ip", "netns", "del", &ns], || ip(&["netns", "add", &ns]))?;
            ip(&[
                "link", "add", &host.veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ])?;
            ip(&["link", "set", &host.veth, "master", &bridge, "up"])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/24", host.ip),
                "dev",
                "eth0",
            ])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            net.hosts.push(host);
        }
        Ok(net)
    }

    /// Does `make`, with `undo` registered first (undoing what was never made does no harm).
    pub(super) fn made(&mut self, undo: &[&str], make: impl FnOnce() -> Result<()>) -> Result<()> {
        let c = undo::command(undo);
        undo::lock().add_command(c.clone());
        self.undo.push(c);
        make()
    }

    /// `program` to be run inside host `h`'s namespace.
    pub fn command(&self, h: usize, program: &std::path::Path) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.hosts[h].netns]).arg(program);
        c
    }

    /// Cuts host `h` off the bridge (or the router it hangs on), or links it again.
    pub fn set_link(&self, h: usize, up: bool) -> Result<()> {
        let host = &self.hosts[h];
        let state = if up { "up" } else { "down" };
        match &host.behind {
            None => ip(&["link", "set", &host.veth, state]),
            Some(ns) => ip(&["-n", ns, "link", "set", &host.veth, state]),
        }
    }

    /// Drops `percent` % of the packets host `h` sends or receives on its link, at random
    /// (0: none). The rule lives in the host's namespace and goes with it.
    pub fn set_loss(&self, h: usize, percent: u32) -> Result<()> {
        let ns = &self.hosts[h].netns;
        // Deleting a table that is not there fails; that is the state wanted.
        let _ = nft(ns, "delete table inet chaos\n");
        if percent == 0 {
            return Ok(());
        }
        nft(
            ns,
            &format!(
                "table inet chaos {{\n\
                   chain input {{ type filter hook input priority 0; \
                     iifname \"eth0\" numgen random mod 100 < {percent} drop; }}\n\
                   chain output {{ type filter hook output priority 0; \
                     oifname \"eth0\" numgen random mod 100 < {percent} drop; }}\n\
                 }}\n"
            ),
        )
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for c in self.undo.iter().rev() {
            undo::lock().remove_command(c);
            undo::run(c);
        }
    }
}

/// The namespace of host `name` in this soak.
pub(super) fn netns_name(name: &str) -> String {
    format!("rserpool-chaos-{}-{name}", std::process::id())
}

/// `10.201.N`, the first N from `tag` on whose /24 no route here lies.
fn free_subnet(tag: u32) -> Result<String> {
    let out = Command::new("ip")
        .args(["-4", "route", "show"])
        .output()
        .context("running ip (iproute2)")?;
    let routes = String::from_utf8_lossy(&out.stdout);
    (0..250)
        .map(|k| format!("10.201.{}", (tag + k) % 250))
        .find(|s| !routes.contains(&format!("{s}.")))
        .context("no free 10.201.N.0/24 for the soak's bridge")
}

pub(super) fn ip(args: &[&str]) -> Result<()> {
    run_tool("ip", args, "iproute2")
}

/// Feeds `rules` to `nft -f -` inside namespace `ns`.
fn nft(ns: &str, rules: &str) -> Result<()> {
    use std::io::Write;
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns, "nft", "-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("running nft (nftables)")?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(rules.as_bytes())?;
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "nft in {ns}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}
