//! The `[levels]` section: the settings of service levels; what they do, with an example, is
//! in the balancing room's `levels` module (docs/LEVELS.md).

use rserpool_asap::share::Discipline;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::str::FromStr;

/// The level header's default name.
pub const DEFAULT_HEADER: &str = "x-rserpool-level";

/// The `[levels]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct LevelsConfig {
    pub count: usize,
    pub default: usize,
    pub scheduler: Scheduler,
    pub header: String,
    pub half_life_ms: u64,
    pub retry_after_s: u32,
    #[serde(rename = "rule", skip_serializing_if = "Vec::is_empty")]
    pub rules: Vec<LevelRule>,
    /// Per level (by number): domain and queue limits.
    #[serde(rename = "level", skip_serializing_if = "BTreeMap::is_empty")]
    pub levels: BTreeMap<String, LevelConfig>,
}

impl Default for LevelsConfig {
    fn default() -> Self {
        Self {
            count: 9,
            default: 1,
            scheduler: Scheduler::Lottery,
            header: DEFAULT_HEADER.into(),
            half_life_ms: 1000,
            retry_after_s: 1,
            rules: Vec::new(),
            levels: BTreeMap::new(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scheduler {
    #[default]
    Lottery,
    Stride,
}

impl From<Scheduler> for Discipline {
    fn from(s: Scheduler) -> Self {
        match s {
            Scheduler::Lottery => Discipline::Lottery,
            Scheduler::Stride => Discipline::Stride,
        }
    }
}

/// One classification rule: every condition given must hold.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct LevelRule {
    pub level: usize,
    /// Client address in this CIDR block (`10.0.0.0/8`, `2001:db8::/32`, or one address).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<Cidr>,
    /// Host header (without port, case-insensitive).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path_prefix: Option<String>,
    /// A request header's name; with `value`, its value must equal it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
}

/// Settings of one level.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct LevelConfig {
    pub lower: Option<u32>,
    pub upper: Option<u32>,
    /// Most requests of this level waiting at one pool (the pool's `queue` bounds them all).
    pub queue_limit: Option<usize>,
    /// Longest wait of a request of this level (else the pool's `queue-timeout-ms`).
    pub queue_timeout_ms: Option<u64>,
}

/// An address block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    pub addr: IpAddr,
    pub prefix: u8,
}

impl Cidr {
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = match (self.addr, ip) {
            (IpAddr::V4(_), IpAddr::V6(v6)) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            _ => ip,
        };
        match (self.addr, ip) {
            (IpAddr::V4(a), IpAddr::V4(b)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(a) & mask == u32::from(b) & mask
            }
            (IpAddr::V6(a), IpAddr::V6(b)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(a) & mask == u128::from(b) & mask
            }
            _ => false,
        }
    }
}

impl FromStr for Cidr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (a, p) = s.split_once('/').unwrap_or((s, ""));
        let addr: IpAddr = a.parse().map_err(|_| format!("bad address in {s:?}"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = if p.is_empty() {
            max
        } else {
            p.parse::<u8>()
                .ok()
                .filter(|&n| n <= max)
                .ok_or_else(|| format!("bad prefix length in {s:?}"))?
        };
        Ok(Self { addr, prefix })
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl Serialize for Cidr {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Cidr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}
