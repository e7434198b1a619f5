//! The `[tier]` section: a proxy's membership of a proxy tier (docs/TIER.md).

use serde::{Deserialize, Serialize};
use std::net::{Ipv4Addr, SocketAddr};

/// The `[tier]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct TierConfig {
    /// The tier's pool handle: every member registers in it.
    pub pool: String,
    /// This member's tier address: links with the other members (TCP) and the distributor's
    /// heartbeats (UDP), and its transport in the tier pool. An address of its own, not a
    /// shared one.
    pub listen: SocketAddr,
    /// The server-facing address every member shares: connections to PEs come from it.
    pub server_address: Ipv4Addr,
    /// This member's source ports on `server-address`, "FIRST-LAST"; no two members may
    /// overlap.
    pub ports: String,
    /// The interface on the segment the members share with the router (where a packet for
    /// another member's port goes back out) [default: the first `[kernel-splice]` interface].
    #[serde(default)]
    pub interface: Option<String>,
}

impl TierConfig {
    /// `ports` as a range.
    pub fn port_range(&self) -> Result<std::ops::RangeInclusive<u16>, String> {
        let (a, b) = self
            .ports
            .split_once('-')
            .ok_or_else(|| format!("[tier] ports {:?}: expected FIRST-LAST", self.ports))?;
        let (a, b) = (a.trim().parse::<u16>(), b.trim().parse::<u16>());
        match (a, b) {
            (Ok(a), Ok(b)) if 0 < a && a <= b => Ok(a..=b),
            _ => Err(format!(
                "[tier] ports {:?}: expected FIRST-LAST, 1 ≤ FIRST ≤ LAST ≤ 65535",
                self.ports
            )),
        }
    }
}
