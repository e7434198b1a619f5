//! Service levels: which level a request belongs to, and each level's priority domain.
//!
//! Why: under overload the proxy's admission queue (`admit`) serves levels in
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

pub use crate::config::levels::{
    Cidr, DEFAULT_HEADER, LevelConfig, LevelRule, LevelsConfig, Scheduler,
};
use rserpool_asap::share::Domain;
use std::net::IpAddr;

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
        #[derive(serde::Deserialize)]
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
