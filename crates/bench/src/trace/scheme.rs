//! The schemes the trace benchmark compares: how the PEs register, what is in front of them
//! (`rserpool proxy` with a selection, or HAProxy with a balance algorithm), and which HAProxy
//! scheme each rserpool scheme is held against.

use anyhow::{Result, bail};

pub const SCHEMES: &str = "rr,wrr,lu,least-connections,p2c,prequal,maglev,ring-hash,dpr,dpr-q,\
     haproxy-rr,haproxy-wrr,haproxy-leastconn,haproxy-agent";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    Rr,
    Wrr,
    Lu,
    LeastConnections,
    P2c,
    Prequal,
    Maglev,
    RingHash,
    Dpr,
    DprQ,
    HaproxyRr,
    HaproxyWrr,
    HaproxyLeastconn,
    HaproxyAgent,
}

impl Scheme {
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "rr" => Self::Rr,
            "wrr" => Self::Wrr,
            "lu" => Self::Lu,
            "least-connections" => Self::LeastConnections,
            "p2c" => Self::P2c,
            "prequal" => Self::Prequal,
            "maglev" => Self::Maglev,
            "ring-hash" => Self::RingHash,
            "dpr" => Self::Dpr,
            "dpr-q" => Self::DprQ,
            "haproxy-rr" => Self::HaproxyRr,
            "haproxy-wrr" => Self::HaproxyWrr,
            "haproxy-leastconn" => Self::HaproxyLeastconn,
            "haproxy-agent" => Self::HaproxyAgent,
            _ => bail!("unknown scheme {s:?} (one of {SCHEMES})"),
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Rr => "RR",
            Self::Wrr => "WRR",
            Self::Lu => "LU",
            Self::LeastConnections => "least-conn",
            Self::P2c => "P2C",
            Self::Prequal => "Prequal",
            Self::Maglev => "Maglev",
            Self::RingHash => "ring hash",
            Self::Dpr => "DPR",
            Self::DprQ => "DPR-Q",
            Self::HaproxyRr => "HAProxy roundrobin",
            Self::HaproxyWrr => "HAProxy roundrobin weighted",
            Self::HaproxyLeastconn => "HAProxy leastconn",
            Self::HaproxyAgent => "HAProxy+agent",
        }
    }

    pub fn haproxy(self) -> bool {
        matches!(
            self,
            Self::HaproxyRr | Self::HaproxyWrr | Self::HaproxyLeastconn | Self::HaproxyAgent
        )
    }

    /// HAProxy's `balance` and whether its servers carry the capacities as weights.
    pub fn haproxy_balance(self) -> (&'static str, bool) {
        match self {
            Self::HaproxyRr => ("roundrobin", false),
            Self::HaproxyWrr => ("roundrobin", true),
            _ => ("leastconn", true),
        }
    }

    /// The PEs' `example` flags for a back end of `workers`.
    pub fn pe_flags(self, workers: usize) -> Vec<String> {
        let v: Vec<&str> = match self {
            // The proxy-local selections learn the capacities as weights, as HAProxy's
            // servers are given them.
            Self::Wrr | Self::LeastConnections | Self::P2c | Self::Prequal => {
                return ["--policy", "wrr", "--weight", &workers.to_string()]
                    .map(String::from)
                    .to_vec();
            }
            Self::Lu => vec!["--policy", "lu"],
            Self::Dpr => vec!["--policy", "credits", "--credit-reporting", "dpr"],
            Self::DprQ => vec!["--policy", "credits", "--credit-reporting", "dpr-q"],
            _ => vec!["--policy", "rr"],
        };
        v.into_iter().map(String::from).collect()
    }

    /// `[pool.NAME] select`.
    pub fn select(self) -> &'static str {
        match self {
            Self::LeastConnections => "least-connections",
            Self::P2c => "p2c",
            Self::Prequal => "prequal",
            Self::Maglev => "maglev",
            Self::RingHash => "ring-hash",
            _ => "policy",
        }
    }

    /// The HAProxy scheme of the same kind, which this one must fail no more requests than
    /// (the targets): RR against `roundrobin`, WRR against `roundrobin` with the same
    /// weights, the adaptive and hashing ones against `leastconn`; none for credits (whose
    /// target is no failure at all) and for HAProxy itself.
    pub fn rival(self) -> Option<Scheme> {
        match self {
            Self::Rr => Some(Self::HaproxyRr),
            Self::Wrr => Some(Self::HaproxyWrr),
            Self::Lu
            | Self::LeastConnections
            | Self::P2c
            | Self::Prequal
            | Self::Maglev
            | Self::RingHash => Some(Self::HaproxyLeastconn),
            _ => None,
        }
    }

    /// Whether its p99 first response time must be at most 0.8× its rival's.
    pub fn p99_target(self) -> bool {
        matches!(self, Self::LeastConnections | Self::P2c | Self::Prequal)
    }

    pub fn credits(self) -> bool {
        matches!(self, Self::Dpr | Self::DprQ)
    }
}
