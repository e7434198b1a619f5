//! Proxy settings: one TOML file (or the flags of `rserpool proxy` for a single listener).
//!
//! ```toml
//! registrars = ["127.0.0.1:3863"]
//! refresh-ms = 500
//! status = "127.0.0.1:8404"
//!
//! [[listener]]
//! listen = "0.0.0.0:8080"
//! mode = "http"
//! pool = "WebPool"            # requests no route matches
//!
//! [[listener.route]]
//! host = "api.example.com"    # optional; any host if absent
//! prefix = "/v1/"             # longest matching prefix wins
//! pool = "ApiPool"
//!
//! [[listener]]
//! listen = "0.0.0.0:7000"
//! mode = "tcp"
//! pool = "EchoPool"
//! ```

use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Tcp,
    Http,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Route {
    /// Host header to match (without port, case-insensitive); any host when absent.
    #[serde(default)]
    pub host: Option<String>,
    /// Path prefix to match.
    #[serde(default = "slash")]
    pub prefix: String,
    pub pool: String,
}

fn slash() -> String {
    "/".into()
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ListenerConfig {
    pub listen: SocketAddr,
    pub mode: Mode,
    /// The pool for connections (TCP) or for requests no route matches (HTTP).
    #[serde(default)]
    pub pool: Option<String>,
    #[serde(default, rename = "route")]
    pub routes: Vec<Route>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct ProxyConfig {
    /// Registrars' ASAP addresses, tried in order.
    pub registrars: Vec<SocketAddr>,
    /// How often each pool's PEs and load are fetched from a registrar.
    pub refresh_ms: u64,
    /// Most client connections at once; further ones wait in the listen backlog.
    pub max_connections: usize,
    pub connect_timeout_ms: u64,
    /// A client connection (or TCP-mode forwarding) without traffic for this long is closed.
    pub idle_timeout_ms: u64,
    /// Longest wait for a request head from a client and for a response head from a PE
    /// (408 / 504 after it).
    pub request_timeout_ms: u64,
    /// Failures in a row that eject a PE locally; the first ejection lasts `eject-ms`, each
    /// next one in a row twice as long, up to `eject-max-ms`.
    pub max_fails: u32,
    pub eject_ms: u64,
    pub eject_max_ms: u64,
    /// Idle keep-alive connections kept per PE (HTTP).
    pub max_idle_per_pe: usize,
    /// Request bodies up to this size are held, so that an idempotent request can be retried
    /// on another PE; larger ones are streamed.
    pub retry_buffer: usize,
    /// Largest request or response head.
    pub max_head: usize,
    /// On SIGTERM, how long in-flight work may take before the proxy exits anyway.
    pub drain_timeout_ms: u64,
    /// Zero-copy forwarding with splice(2) in TCP mode.
    pub splice: bool,
    /// Worker threads (0 = one per core).
    pub threads: usize,
    /// Status listener: per-PE counters as JSON on `http://ADDR/status` (`stats`, the older
    /// name of this key, is read too).
    #[serde(alias = "stats")]
    pub status: Option<SocketAddr>,
    /// Append one line per request (HTTP) or connection (TCP) to this file; `-` is stdout.
    pub access_log: Option<PathBuf>,
    #[serde(rename = "listener")]
    pub listeners: Vec<ListenerConfig>,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            registrars: vec![SocketAddr::from(([127, 0, 0, 1], rserpool_wire::ASAP_PORT))],
            refresh_ms: 500,
            max_connections: 10_000,
            connect_timeout_ms: 1000,
            idle_timeout_ms: 60_000,
            request_timeout_ms: 30_000,
            max_fails: 1,
            eject_ms: 1000,
            eject_max_ms: 30_000,
            max_idle_per_pe: 256,
            retry_buffer: 64 * 1024,
            max_head: 64 * 1024,
            drain_timeout_ms: 30_000,
            splice: true,
            threads: 0,
            status: None,
            access_log: None,
            listeners: Vec::new(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{0}")]
    Toml(#[from] toml::de::Error),
    #[error("{0}")]
    Invalid(String),
}

impl ProxyConfig {
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let cfg: Self = toml::from_str(text)?;
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.listeners.is_empty() {
            return bad("no listener configured".into());
        }
        if self.registrars.is_empty() {
            return bad("no registrar configured".into());
        }
        for (i, l) in self.listeners.iter().enumerate() {
            if self.listeners[..i].iter().any(|o| o.listen == l.listen) {
                return bad(format!("listener {} configured twice", l.listen));
            }
            match l.mode {
                Mode::Tcp if l.pool.is_none() => {
                    return bad(format!("TCP listener {} needs a pool", l.listen));
                }
                Mode::Tcp if !l.routes.is_empty() => {
                    return bad(format!("TCP listener {} cannot route by HTTP", l.listen));
                }
                Mode::Http if l.pool.is_none() && l.routes.is_empty() => {
                    return bad(format!("HTTP listener {} needs a pool or routes", l.listen));
                }
                _ => {}
            }
            for r in &l.routes {
                if !r.prefix.starts_with('/') {
                    return bad(format!("route prefix {:?} must start with /", r.prefix));
                }
            }
        }
        for (name, v) in [
            ("refresh-ms", self.refresh_ms),
            ("connect-timeout-ms", self.connect_timeout_ms),
            ("idle-timeout-ms", self.idle_timeout_ms),
            ("request-timeout-ms", self.request_timeout_ms),
        ] {
            if v == 0 {
                return bad(format!("{name} must be above 0"));
            }
        }
        if self.max_connections == 0 {
            return bad("max-connections must be above 0".into());
        }
        if self.max_head < 1024 {
            return bad("max-head must be at least 1024".into());
        }
        Ok(())
    }

    /// Every pool a listener names.
    pub fn pools(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .listeners
            .iter()
            .flat_map(|l| l.pool.iter().chain(l.routes.iter().map(|r| &r.pool)))
            .cloned()
            .collect();
        v.sort();
        v.dedup();
        v
    }

    pub fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_documented_example_parses() {
        let doc = include_str!("config.rs");
        let text: String = doc
            .lines()
            .skip_while(|l| !l.starts_with("//! ```toml"))
            .skip(1)
            .take_while(|l| !l.starts_with("//! ```"))
            .map(|l| format!("{}\n", l.trim_start_matches("//!").trim_start()))
            .collect();
        let cfg = ProxyConfig::from_toml(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert_eq!(cfg.listeners.len(), 2);
        assert_eq!(cfg.listeners[0].routes[0].pool, "ApiPool");
        assert_eq!(cfg.pools(), ["ApiPool", "EchoPool", "WebPool"]);
    }

    #[test]
    fn mistakes_are_named() {
        let e = ProxyConfig::from_toml("[[listener]]\nlisten = \"127.0.0.1:1\"\nmode = \"tcp\"\n");
        assert!(e.unwrap_err().to_string().contains("needs a pool"));
        let e = ProxyConfig::from_toml("refresh-msec = 5\n");
        assert!(e.unwrap_err().to_string().contains("unknown field"));
    }
}
