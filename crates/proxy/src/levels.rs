//! Service levels: which level a request belongs to, and each level's priority domain.
//!
//! Why: under overload the proxy's admission queue ([`crate::admit`]) serves levels in
//! proportion to their tickets (seed `differentiated-services-clusters`), so something must
//! say which level a request is. Ordered rules match the client's source address (HTTP and
//! TCP), and in HTTP mode the Host, a path prefix, or a header's presence or value (an API
//! key); the first rule that matches gives the level, else the default. The level goes on to
//! the PE in a header, which a client's own copy never survives.
//!
//! ```toml
//! [levels]
//! count = 9                      # levels 1 ..= count; higher is better
//! default = 1
//! scheduler = "lottery"          # or "stride"
//! header = "x-rserpool-level"    # sent to the PE; a client's own is removed
//! half-life-ms = 1000            # how fast consumption is forgotten
//! retry-after-s = 1              # on a 503 when a level is shed
//!
//! [[levels.rule]]
//! source = "10.1.0.0/16"
//! level = 7
//!
//! [[levels.rule]]
//! header = "x-api-key"
//! value = "gold-123"             # without value: the header's presence
//! level = 9
//!
//! [[levels.rule]]
//! host = "batch.example.com"
//! path-prefix = "/reports/"
//! level = 2
//!
//! [levels.level.9]
//! lower = 900                    # the priority domain, in tickets
//! upper = 999
//! queue-limit = 512              # requests of this level waiting at a pool
//! queue-timeout-ms = 2000        # longest wait, then 503
//! ```

use rserpool_asap::share::{Discipline, Domain};
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

/// What of a request the rules look at; HTTP fields are `None` in TCP mode.
pub struct RequestFacts<'a> {
    pub source: IpAddr,
    pub host: Option<&'a str>,
    pub path: Option<&'a str>,
    /// A header's value by name (case-insensitive).
    pub header: &'a dyn Fn(&str) -> Option<&'a str>,
}

impl LevelsConfig {
    /// Checks the section; the message names what is wrong.
    pub fn validate(&self) -> Result<(), String> {
        if !(1..=64).contains(&self.count) {
            return Err("levels: count must be 1 ..= 64".into());
        }
        let in_range = |l: usize| (1..=self.count).contains(&l);
        if !in_range(self.default) {
            return Err(format!("levels: default {} is not a level", self.default));
        }
        if self.header.is_empty() || !self.header.bytes().all(is_token_byte) {
            return Err(format!(
                "levels: header {:?} is not a header name",
                self.header
            ));
        }
        if self.half_life_ms == 0 {
            return Err("levels: half-life-ms must be above 0".into());
        }
        for r in &self.rules {
            if !in_range(r.level) {
                return Err(format!("levels: a rule names level {}", r.level));
            }
            if r.value.is_some() && r.header.is_none() {
                return Err("levels: a rule has a value but no header".into());
            }
            if r.source.is_none()
                && r.host.is_none()
                && r.path_prefix.is_none()
                && r.header.is_none()
            {
                return Err(format!(
                    "levels: a rule for level {} has no condition (use `default`)",
                    r.level
                ));
            }
        }
        for (name, c) in &self.levels {
            let l: usize = name.parse().ok().filter(|&l| in_range(l)).ok_or_else(|| {
                format!("[levels.level.{name}] is not a level 1 ..= {}", self.count)
            })?;
            let d = self.domain(l);
            if d.lower == 0 || d.lower > d.upper {
                return Err(format!(
                    "[levels.level.{name}]: need 0 < lower <= upper (have {} .. {})",
                    d.lower, d.upper
                ));
            }
            if c.queue_timeout_ms.is_some_and(|t| t > 60_000) {
                return Err(format!(
                    "[levels.level.{name}]: queue-timeout-ms above a minute"
                ));
            }
        }
        Ok(())
    }

    fn level(&self, l: usize) -> Option<&LevelConfig> {
        self.levels.get(&l.to_string())
    }

    /// Level `l`'s priority domain (1-based).
    pub fn domain(&self, l: usize) -> Domain {
        let d = Domain::default_for(l);
        let c = self.level(l);
        Domain {
            lower: c.and_then(|c| c.lower).unwrap_or(d.lower),
            upper: c.and_then(|c| c.upper).unwrap_or(d.upper),
        }
    }

    pub fn domains(&self) -> Vec<Domain> {
        (1..=self.count).map(|l| self.domain(l)).collect()
    }

    /// Level `l`'s queue limit and timeout, where configured.
    pub fn queue_limit(&self, l: usize) -> Option<usize> {
        self.level(l).and_then(|c| c.queue_limit)
    }

    pub fn queue_timeout_ms(&self, l: usize) -> Option<u64> {
        self.level(l).and_then(|c| c.queue_timeout_ms)
    }

    /// The level of a request: the first matching rule's, else the default.
    pub fn classify(&self, r: &RequestFacts<'_>) -> usize {
        self.rules
            .iter()
            .find(|rule| rule.matches(r))
            .map_or(self.default, |rule| rule.level)
    }
}

impl LevelRule {
    fn matches(&self, r: &RequestFacts<'_>) -> bool {
        if let Some(c) = &self.source
            && !c.contains(r.source)
        {
            return false;
        }
        if let Some(h) = &self.host {
            let Some(host) = r.host else { return false };
            let host = strip_port(host);
            if !host.eq_ignore_ascii_case(h) {
                return false;
            }
        }
        if let Some(p) = &self.path_prefix {
            let Some(path) = r.path else { return false };
            if !path.starts_with(p.as_str()) {
                return false;
            }
        }
        if let Some(name) = &self.header {
            let Some(v) = (r.header)(name) else {
                return false;
            };
            if self.value.as_ref().is_some_and(|want| want != v.trim()) {
                return false;
            }
        }
        true
    }
}

fn strip_port(host: &str) -> &str {
    if host.starts_with('[') {
        return host.split_once(']').map_or(host, |(h, _)| &h[1..]);
    }
    host.rsplit_once(':').map_or(host, |(h, _)| h)
}

fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc_example() -> LevelsConfig {
        let text = crate::config::doc_toml(include_str!("levels.rs"));
        #[derive(Deserialize)]
        struct Wrap {
            levels: LevelsConfig,
        }
        let w: Wrap = toml::from_str(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        w.levels.validate().unwrap();
        w.levels
    }

    fn facts<'a>(
        src: &str,
        host: Option<&'a str>,
        path: Option<&'a str>,
        headers: &'a dyn Fn(&str) -> Option<&'a str>,
    ) -> RequestFacts<'a> {
        RequestFacts {
            source: src.parse().unwrap(),
            host,
            path,
            header: headers,
        }
    }

    #[test]
    fn the_documented_rules_classify_in_order() {
        let c = doc_example();
        let none = |_: &str| None;
        let key = |n: &str| (n.eq_ignore_ascii_case("x-api-key")).then_some("gold-123");
        let wrong_key = |n: &str| (n.eq_ignore_ascii_case("x-api-key")).then_some("nope");
        assert_eq!(c.classify(&facts("10.1.2.3", None, None, &none)), 7);
        assert_eq!(c.classify(&facts("10.2.0.1", None, None, &none)), 1);
        assert_eq!(
            c.classify(&facts("192.0.2.1", Some("a"), Some("/"), &key)),
            9
        );
        assert_eq!(
            c.classify(&facts("192.0.2.1", Some("a"), Some("/"), &wrong_key)),
            1
        );
        // Source first: a 10.1/16 client with the key is level 7.
        assert_eq!(c.classify(&facts("10.1.0.9", None, None, &key)), 7);
        let batch = facts(
            "192.0.2.1",
            Some("Batch.Example.com:8080"),
            Some("/reports/x"),
            &none,
        );
        assert_eq!(c.classify(&batch), 2);
        let other = facts(
            "192.0.2.1",
            Some("batch.example.com"),
            Some("/other"),
            &none,
        );
        assert_eq!(c.classify(&other), 1);
        // TCP mode: no host or path, only source rules can match.
        assert_eq!(c.classify(&facts("192.0.2.1", None, None, &none)), 1);
        assert_eq!(
            c.domain(9),
            Domain {
                lower: 900,
                upper: 999
            }
        );
        assert_eq!(c.domain(3), Domain::default_for(3));
        assert_eq!(c.queue_limit(9), Some(512));
        assert_eq!(c.queue_timeout_ms(1), None);
    }

    #[test]
    fn cidr_blocks_match_v4_v6_and_mapped() {
        let c: Cidr = "10.0.0.0/8".parse().unwrap();
        assert!(c.contains("10.255.0.1".parse().unwrap()));
        assert!(!c.contains("11.0.0.1".parse().unwrap()));
        assert!(c.contains("::ffff:10.0.0.1".parse().unwrap()));
        let one: Cidr = "127.0.0.2".parse().unwrap();
        assert!(one.contains("127.0.0.2".parse().unwrap()));
        assert!(!one.contains("127.0.0.1".parse().unwrap()));
        let all: Cidr = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains("8.8.8.8".parse().unwrap()));
        let v6: Cidr = "2001:db8::/32".parse().unwrap();
        assert!(v6.contains("2001:db8:1::1".parse().unwrap()));
        assert!(!v6.contains("2001:db9::1".parse().unwrap()));
        assert!("10.0.0.0/33".parse::<Cidr>().is_err());
        assert!("ten/8".parse::<Cidr>().is_err());
    }

    #[test]
    fn mistakes_are_named() {
        let bad = |c: LevelsConfig, want: &str| {
            let e = c.validate().unwrap_err();
            assert!(e.contains(want), "{e}");
        };
        bad(
            LevelsConfig {
                default: 10,
                ..Default::default()
            },
            "default 10",
        );
        let mut c = LevelsConfig::default();
        c.rules.push(LevelRule {
            level: 3,
            source: None,
            host: None,
            path_prefix: None,
            header: None,
            value: None,
        });
        bad(c, "no condition");
        let mut c = LevelsConfig::default();
        c.levels.insert("12".into(), LevelConfig::default());
        bad(c, "not a level");
        let mut c = LevelsConfig::default();
        c.levels.insert(
            "2".into(),
            LevelConfig {
                lower: Some(500),
                upper: Some(100),
                ..Default::default()
            },
        );
        bad(c, "lower <= upper");
        bad(
            LevelsConfig {
                header: "bad header".into(),
                ..Default::default()
            },
            "not a header",
        );
    }
}
