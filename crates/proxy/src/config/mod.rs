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
//!
//! [pool.ApiPool]              # optional, per pool handle
//! select = "p2c"              # policy (default) | least-connections | p2c | prequal
//!                             # | maglev | ring-hash
//! hash-key = "source"         # their key: source | path | header:NAME | cookie:NAME
//! sticky-cookie = "SRV"       # the proxy sets a cookie naming the PE; requests go back to it
//! max-conn = 32               # most requests in flight per PE; beyond, requests wait
//! queue = 1024                # most requests waiting (for max-conn, or credits)
//! queue-timeout-ms = 1000     # longest wait, then 503
//! max-ejection-percent = 10   # most PEs ejected as dead at once (at least one)
//! panic-threshold = 50        # below this % healthy PEs, spread over all of them
//! busy-ms = 1000              # a busy PE (connect timeout, 503) gets no new work this long
//! consecutive-5xx = 5         # 5xx answers in a row (503 aside) that eject a PE (0: off)
//! success-rate-interval-ms = 10000  # success-rate outliers looked for this often (0: off)
//! success-rate-min-requests = 100   # among PEs with this many answers in the interval,
//! success-rate-min-hosts = 5        # when at least this many have them: below the mean
//! success-rate-stdev-factor = 1.9   # by this many standard deviations is ejected
//! retry-budget-percent = 20   # retries under way: at most 20 % of the requests under way,
//! retry-budget-min = 3        # or 3, whichever is more
//! try-timeout-ms = 0          # a PE slower than this to answer: the request goes elsewhere
//! retry-backoff-ms = 25       # a retry waits a random time up to this first
//! slow-start-ms = 0           # a new or returning PE's share ramps up over this (0: off)
//! max-requests = 10000        # circuit breaker: requests under way at the pool, then 503
//! ```
//!
//! Service levels (`[levels]`) are described in the balancing room's `levels`, a proxy tier
//! (`[tier]`) in docs/TIER.md.

pub mod levels;
mod tier;

pub use levels::LevelsConfig;
pub use tier::TierConfig;

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Tcp,
    Http,
}

impl std::fmt::Display for Mode {
    /// As the config file names it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Tcp => "tcp",
            Self::Http => "http",
        })
    }
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
    /// `"kernel"`: a request on this route pins its connection to the PE chosen for it; the
    /// rest of the connection (this request's body and response, later requests) goes to
    /// that PE unchanged, through the kernel splice. Default: the listener's `splice`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub splice: Option<SpliceMode>,
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
    /// `"kernel"`: a TCP listener hands each connection, once connected to its PE, to the
    /// kernel splice (`[kernel-splice]`); on an HTTP listener, each route (unless it says
    /// otherwise) pins a connection to the PE of its first request and hands it over.
    /// `"user"` (the default) relays in this process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub splice: Option<SpliceMode>,
    /// HTTPS: the certificates this HTTP listener offers (`[[listener.certificate]]`: `cert`,
    /// `key`, `names`), picked by the name the client asks for (SNI); none: plain HTTP.
    #[serde(default, rename = "certificate", skip_serializing_if = "Vec::is_empty")]
    pub certificates: Vec<rserpool_tls::Certificate>,
    /// HTTP/2 from clients (HTTP listeners): offered by ALPN (`h2`, then `http/1.1`) on HTTPS,
    /// and taken in cleartext from a client that starts with the HTTP/2 preface (h2c with
    /// prior knowledge). Limits in `[http2]`.
    #[serde(default = "yes")]
    pub http2: bool,
    /// Whether the kernel hands a connection over only once its first bytes are there
    /// (`TCP_DEFER_ACCEPT`; one that sends nothing is handed over after about a second, later
    /// if packets are lost): the first read then finds the request.
    /// By default on for HTTP listeners and off for TCP ones (a protocol whose server speaks
    /// first would wait a second for every connection); `true` suits a TCP listener whose
    /// clients speak first (TLS passed through, for one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub defer_accept: Option<bool>,
}

fn yes() -> bool {
    true
}

impl ListenerConfig {
    /// `defer-accept`, or its default for the listener's mode.
    pub fn defers_accept(&self) -> bool {
        self.defer_accept.unwrap_or(self.mode == Mode::Http)
    }

    /// Whether any connection of this listener may go to the kernel splice.
    pub fn kernel_splice(&self) -> bool {
        self.splice == Some(SpliceMode::Kernel)
            || self
                .routes
                .iter()
                .any(|r| r.splice == Some(SpliceMode::Kernel))
    }
}

/// Who carries a connection's bytes once it is routed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SpliceMode {
    /// This process: splice(2) between the two sockets.
    User,
    /// The kernel splice's eBPF datapath; the proxy's sockets are gone (docs/KSPLICE.md).
    Kernel,
}

/// The `[kernel-splice]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct KernelSpliceConfig {
    /// The interfaces the datapath is attached to: those the clients' and the PEs' packets
    /// arrive on.
    pub interfaces: Vec<String>,
    /// Spliced connections at most (two flow entries each).
    pub max_flows: u32,
    /// Where the flow table is pinned (on bpffs), so that it outlives the proxy.
    pub pin_dir: PathBuf,
    /// A spliced connection without a packet for this long is removed.
    pub idle_timeout_ms: u64,
    /// A spliced connection closed in both directions (FIN) is removed once quiet this long
    /// (late retransmissions and the last ACK still get through).
    pub fin_timeout_ms: u64,
    /// A connection busy this long without a quiet moment (a download, an upload) is held
    /// so that it drains and can be handed over; its senders then retransmit what the hold
    /// dropped, a stall of a retransmission timeout once. 0: never held.
    pub hold_after_ms: u64,
    /// A held connection whose sockets drain nothing for this long stays in user space.
    pub drain_stall_ms: u64,
    /// A held connection not drained within this stays in user space.
    pub drain_timeout_ms: u64,
}

impl Default for KernelSpliceConfig {
    fn default() -> Self {
        Self {
            interfaces: Vec::new(),
            max_flows: 65_536,
            pin_dir: PathBuf::from("/sys/fs/bpf/rserpool"),
            idle_timeout_ms: 3_600_000,
            fin_timeout_ms: 10_000,
            hold_after_ms: 500,
            drain_stall_ms: 100,
            drain_timeout_ms: 2000,
        }
    }
}

/// How the proxy chooses among a pool's PEs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Select {
    /// The pool's own policy, as its PEs registered it (RFC 5356's, or `credits`).
    #[default]
    Policy,
    /// The fewest requests (connections in TCP mode) this proxy has in flight at the PE, per
    /// its weight (a WRR weight or a credits capacity it registered with; 1 otherwise), as
    /// HAProxy's `leastconn` with server weights.
    LeastConnections,
    /// Power of two choices: of two PEs at random, the one with fewer in flight per weight.
    P2c,
    /// After Prequal (NSDI 2024): a few PEs probed at random, the cold ones (in flight at or
    /// below a quantile of the probed) by lowest estimated latency, else the fewest in flight.
    Prequal,
    /// Maglev consistent hashing (NSDI 2016) of the pool's `hash-key`: the same key goes to
    /// the same PE (on every proxy of a tier too); while that PE is ejected, gone or full the
    /// next one of the key's table serves, and the key returns when it does.
    Maglev,
    /// Ring hash (Ketama, Envoy's `RING_HASH`) of the pool's `hash-key`: as `maglev`, with
    /// fewer keys moving when a PE leaves (only its own) and a less even share.
    RingHash,
}

/// What a consistent-hashing selection hashes (`hash-key`): `"source"` (the client's
/// address, the default), `"path"`, `"header:NAME"` or `"cookie:NAME"`. A request without
/// the header or cookie hashes its source address.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum HashKey {
    #[default]
    Source,
    Path,
    Header(String),
    Cookie(String),
}

impl std::str::FromStr for HashKey {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.split_once(':') {
            None if s == "source" => Ok(Self::Source),
            None if s == "path" => Ok(Self::Path),
            Some(("header", n)) if !n.is_empty() => Ok(Self::Header(n.to_ascii_lowercase())),
            Some(("cookie", n)) if !n.is_empty() => Ok(Self::Cookie(n.to_owned())),
            _ => Err(format!(
                "hash-key {s:?}: one of source, path, header:NAME, cookie:NAME"
            )),
        }
    }
}

impl std::fmt::Display for HashKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Source => f.write_str("source"),
            Self::Path => f.write_str("path"),
            Self::Header(n) => write!(f, "header:{n}"),
            Self::Cookie(n) => write!(f, "cookie:{n}"),
        }
    }
}

impl Serialize for HashKey {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for HashKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

impl Select {
    pub const NAMES: [&str; 6] = [
        "policy",
        "least-connections",
        "p2c",
        "prequal",
        "maglev",
        "ring-hash",
    ];
}

impl std::str::FromStr for Select {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "policy" => Ok(Self::Policy),
            "least-connections" | "leastconn" => Ok(Self::LeastConnections),
            "p2c" => Ok(Self::P2c),
            "prequal" => Ok(Self::Prequal),
            "maglev" => Ok(Self::Maglev),
            "ring-hash" | "ring_hash" => Ok(Self::RingHash),
            _ => Err(format!(
                "unknown selection {s:?} (one of {})",
                Self::NAMES.join(", ")
            )),
        }
    }
}

/// Settings of one pool (`[pool.HANDLE]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct PoolConfig {
    pub select: Select,
    /// Most requests (connections in TCP mode) this proxy has in flight at each PE; none
    /// when absent. A pool with policy `credits` is limited by its PEs' credits as well.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_conn: Option<u64>,
    /// How long a request waits when every PE is at its limit (`max-conn`, or out of
    /// credit), then 503 (`credit-wait-ms`, the older name, is read too).
    #[serde(alias = "credit-wait-ms")]
    pub queue_timeout_ms: u64,
    /// Most requests waiting at once; beyond it the lowest service level is shed (503).
    #[serde(alias = "credit-queue")]
    pub queue: usize,
    /// TLS to the pool's PEs (HTTP listeners; `[pool.NAME.tls]`): their certificates must
    /// chain to `ca` and name the PE's IP address; `cert` and `key`, when given, are presented.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<PeTlsConfig>,
    /// The HTTP version spoken to the pool's PEs (HTTP listeners): `"http1"` (the default,
    /// kept-alive connections, one request at a time) or `"h2"` (HTTP/2 with prior knowledge,
    /// or by ALPN over TLS; streams multiplexed on a few connections per PE; required for
    /// gRPC, whose trailers HTTP/1.1 cannot carry).
    pub protocol: PeProtocol,
    /// Path prefixes of requests that may be sent again to another PE when one fails before
    /// answering, besides the idempotent methods (GET, PUT, …): for gRPC, the idempotent
    /// methods, e.g. `["/helloworld.Greeter/SayHello", "/grpc.health.v1.Health/"]`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub idempotent: Vec<String>,
    /// Most PEs of the pool ejected as dead at once, in percent of the pool (at least one
    /// PE may always be ejected): a failure beyond it is counted, not ejected.
    pub max_ejection_percent: u32,
    /// When fewer than this percentage of the pool's PEs are healthy (neither ejected nor
    /// busy), the proxy spreads over all of them (panic mode): an ejection must never take
    /// the pool down.
    pub panic_threshold: u32,
    /// How long a busy PE (its connect timed out, or it answered 503) gets no new work while
    /// others have room; it is not ejected.
    pub busy_ms: u64,
    /// Outlier detection: this many 5xx answers in a row (503 aside, which means busy) count
    /// as one failure of passive health, which ejects (within `max-ejection-percent`); 0: off.
    pub consecutive_5xx: u32,
    /// Outlier detection by success rate (see `balance/outlier.rs`): every this often, a PE
    /// whose share of good answers lies `success-rate-stdev-factor` standard deviations below
    /// the pool's mean is ejected (within `max-ejection-percent`); 0: off.
    pub success_rate_interval_ms: u64,
    /// … counting only PEs with at least this many answers in the interval …
    pub success_rate_min_requests: u64,
    /// … and only when at least this many PEs have them.
    pub success_rate_min_hosts: usize,
    pub success_rate_stdev_factor: f64,
    /// Retry budget: retries (a request sent again to another PE after one took it and
    /// failed, which may have done the work) under way at once, at most this percentage of
    /// the pool's requests under way …
    pub retry_budget_percent: u32,
    /// … or this many, whichever is more: retries cannot multiply an overload.
    pub retry_budget_min: u32,
    /// Per-try timeout (HTTP): a PE that has not begun its answer this long after the request
    /// is busy, and the request (idempotent, body held) goes once more to another PE within
    /// the retry budget; 0: a try waits for the whole `request-timeout-ms`.
    pub try_timeout_ms: u64,
    /// A request sent again after a PE took it waits a random time up to this first
    /// (jittered back-off), so that retries of a burst do not arrive together.
    pub retry_backoff_ms: u64,
    /// What `select = "maglev"` or `"ring-hash"` hashes.
    pub hash_key: HashKey,
    /// Sticky sessions by a cookie of the proxy's (HTTP; HAProxy's `cookie NAME insert`): a
    /// response from a PE other than the one the request's cookie of this name named sets
    /// it to this PE, and later requests with it go there while it can take them (else by
    /// the selection, and the cookie moves). None when absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sticky_cookie: Option<String>,
    /// Circuit breaker: most requests (connections in TCP mode) under way at the pool's PEs
    /// at once; beyond, an immediate 503 with Retry-After (none when absent). Requests waiting
    /// are bounded by `queue`, those at one PE by `max-conn`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_requests: Option<u64>,
    /// Slow start: a PE that joins the pool or comes back from an ejection takes a share that
    /// ramps from 5 % to its full share over this window (0: at once). Not for `maglev` or `ring-hash`, whose
    /// keys go where they hash, nor `credits`, whose PEs say what they can take.
    pub slow_start_ms: u64,
}

/// `[pool.NAME] protocol`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PeProtocol {
    #[default]
    Http1,
    H2,
}

/// `[http2]`: HTTP/2 from clients, and its limits against the known attacks (docs/HTTP2.md).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct Http2Config {
    /// Streams (requests) a client may have open at once per connection
    /// (SETTINGS_MAX_CONCURRENT_STREAMS).
    pub max_concurrent_streams: u32,
    /// Flow-control window per stream and per connection, bytes.
    pub stream_window: u32,
    pub connection_window: u32,
    /// Largest decoded header list of a request (SETTINGS_MAX_HEADER_LIST_SIZE; against
    /// HPACK bombs and CONTINUATION floods). Default: `max-head`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_header_list_size: Option<u32>,
    /// Streams a client may reset per second on one connection (burst: as many at once);
    /// beyond, GOAWAY ENHANCE_YOUR_CALM (rapid reset, CVE-2023-44487).
    pub max_resets_per_s: u32,
    /// Control frames (PING, SETTINGS, PRIORITY, empty DATA/HEADERS/CONTINUATION) a client
    /// may send per second on one connection (burst: as many at once); beyond, GOAWAY
    /// ENHANCE_YOUR_CALM (PING, SETTINGS and empty-frame floods).
    pub max_control_frames_per_s: u32,
}

impl Default for Http2Config {
    fn default() -> Self {
        Self {
            max_concurrent_streams: 100,
            stream_window: 1 << 20,
            connection_window: 4 << 20,
            max_header_list_size: None,
            max_resets_per_s: 100,
            max_control_frames_per_s: 200,
        }
    }
}

/// `[pool.NAME.tls]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct PeTlsConfig {
    pub ca: PathBuf,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<PathBuf>,
}

impl PeTlsConfig {
    /// The client configuration towards the pool's PEs (its files read now).
    pub fn client(&self) -> Result<Arc<rserpool_tls::rustls::ClientConfig>, String> {
        let identity = match (&self.cert, &self.key) {
            (Some(c), Some(k)) => Some((c.as_path(), k.as_path())),
            (None, None) => None,
            _ => return Err("tls needs both cert and key, or neither".into()),
        };
        rserpool_tls::client_to(&self.ca, identity).map_err(|e| e.to_string())
    }
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            select: Select::Policy,
            max_conn: None,
            queue_timeout_ms: 1000,
            queue: 1024,
            tls: None,
            protocol: PeProtocol::Http1,
            idempotent: Vec::new(),
            max_ejection_percent: 10,
            panic_threshold: 50,
            busy_ms: 1000,
            consecutive_5xx: 5,
            success_rate_interval_ms: 10_000,
            success_rate_min_requests: 100,
            success_rate_min_hosts: 5,
            success_rate_stdev_factor: 1.9,
            retry_budget_percent: 20,
            retry_budget_min: 3,
            try_timeout_ms: 0,
            retry_backoff_ms: 25,
            hash_key: HashKey::Source,
            sticky_cookie: None,
            slow_start_ms: 0,
            max_requests: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct ProxyConfig {
    /// Registrars' ASAP addresses, tried in order: TCP, or SCTP with `sctp+udp://ADDR` (SCTP
    /// over UDP) or `sctp://ADDR` (raw IP, root).
    pub registrars: Vec<rserpool_wire::Address>,
    /// How often each pool's PEs and load are fetched from a registrar.
    pub refresh_ms: u64,
    /// Most client connections at once; further ones wait in the listen backlog.
    pub max_connections: usize,
    pub connect_timeout_ms: u64,
    /// A client connection (or TCP-mode forwarding) without traffic for this long is closed.
    pub idle_timeout_ms: u64,
    /// Longest wait for a response head from a PE (504 after it).
    pub request_timeout_ms: u64,
    /// Longest a client may take to send a request head, from its connection's accept (the
    /// first request: on a listener with `defer-accept`, once its first bytes came or about a
    /// second passed) or from the first byte of a later one on a kept-alive connection (408
    /// after it); the wait for that first byte is `idle-timeout-ms`.
    pub header_timeout_ms: u64,
    /// Failures in a row that eject a PE locally; the first ejection lasts `eject-ms`, each
    /// next one in a row twice as long, up to `eject-max-ms`.
    pub max_fails: u32,
    pub eject_ms: u64,
    pub eject_max_ms: u64,
    /// Idle keep-alive connections kept per PE (HTTP), shared out among the worker threads.
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
    /// Worker threads (0 = one per core), each a runtime of its own serving its share of the
    /// client connections.
    pub threads: usize,
    /// Status listener: per-PE counters as JSON on `http://ADDR/status` (`stats`, the older
    /// name of this key, is read too).
    #[serde(alias = "stats")]
    pub status: Option<SocketAddr>,
    /// Append one line per request (HTTP) or connection (TCP) to this file; `-` is stdout.
    pub access_log: Option<PathBuf>,
    /// Where a new process of this proxy (an upgrade, a restart) takes the listening sockets
    /// over from the running one: a path, or `@NAME` for an abstract Unix socket; `""` turns
    /// the hand-over off. Unset: an abstract name made from the configuration file's path (or,
    /// without a file, from the listeners' addresses). See docs/OPERATIONS.md.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub handover_socket: Option<String>,
    #[serde(rename = "listener")]
    pub listeners: Vec<ListenerConfig>,
    /// Settings per pool handle; a pool not named here has the defaults.
    #[serde(rename = "pool", skip_serializing_if = "BTreeMap::is_empty")]
    pub pool_settings: BTreeMap<String, PoolConfig>,
    /// Service levels; without the section every request is of one level.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub levels: Option<LevelsConfig>,
    /// The kernel splice, for listeners with `splice = "kernel"`.
    #[serde(rename = "kernel-splice")]
    pub kernel_splice: KernelSpliceConfig,
    /// Membership of a fault-tolerant proxy tier (docs/TIER.md): spliced connections are
    /// replicated to the other members.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tier: Option<TierConfig>,
    /// TLS with the registrars (RFC 5355; `[registrar-tls]`: `cert`, `key`, `ca`), when they
    /// run with TLS.
    #[serde(rename = "registrar-tls", skip_serializing_if = "Option::is_none")]
    pub registrar_tls: Option<rserpool_tls::TlsFiles>,
    /// HTTP/2 from clients: its limits.
    pub http2: Http2Config,
    /// Send rsplib's Component Status reports to this monitor (its `cspmonitor` listens on UDP
    /// 2960): the proxy as a pool user, with its connections, pools and PEs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub csp: Option<SocketAddr>,
    /// Interval of the component status reports.
    pub csp_interval_ms: u64,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            registrars: vec![rserpool_wire::Address::tcp(SocketAddr::from((
                [127, 0, 0, 1],
                rserpool_wire::ASAP_PORT,
            )))],
            refresh_ms: 500,
            max_connections: 10_000,
            connect_timeout_ms: 1000,
            idle_timeout_ms: 60_000,
            request_timeout_ms: 30_000,
            header_timeout_ms: 10_000,
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
            handover_socket: None,
            listeners: Vec::new(),
            pool_settings: BTreeMap::new(),
            levels: None,
            kernel_splice: KernelSpliceConfig::default(),
            tier: None,
            registrar_tls: None,
            http2: Http2Config::default(),
            csp: None,
            csp_interval_ms: 1000,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
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
        if let Some(h) = self.handover_socket.as_deref().filter(|h| !h.is_empty())
            && let Err(e) = h.parse::<rserpool_handover::Address>()
        {
            return bad(format!("handover-socket: {e}"));
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
            if !l.certificates.is_empty() {
                if l.mode != Mode::Http {
                    return bad(format!(
                        "listener {}: certificates (HTTPS) need mode = \"http\"",
                        l.listen
                    ));
                }
                if l.kernel_splice() {
                    return bad(format!(
                        "listener {}: HTTPS cannot use the kernel splice (it carries TCP, not \
                         TLS)",
                        l.listen
                    ));
                }
            }
            if l.kernel_splice() {
                if self.kernel_splice.interfaces.is_empty() {
                    return bad(format!(
                        "listener {}: splice = \"kernel\" needs [kernel-splice] interfaces",
                        l.listen
                    ));
                }
                let k = &self.kernel_splice;
                if k.idle_timeout_ms == 0 || k.fin_timeout_ms == 0 || k.max_flows == 0 {
                    return bad(
                        "[kernel-splice] idle-timeout-ms, fin-timeout-ms and max-flows must be \
                         above 0"
                            .into(),
                    );
                }
            }
            if let Some(t) = &self.tier {
                t.port_range().map_err(ConfigError::Invalid)?;
                if self.kernel_splice.interfaces.is_empty() && t.interface.is_none() {
                    return bad("[tier] needs [kernel-splice] interfaces".into());
                }
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
            ("header-timeout-ms", self.header_timeout_ms),
        ] {
            if v == 0 {
                return bad(format!("{name} must be above 0"));
            }
        }
        if self.max_connections == 0 {
            return bad("max-connections must be above 0".into());
        }
        let used = self.pools();
        for (name, p) in &self.pool_settings {
            if !used.contains(name) {
                return bad(format!("[pool.{name}] names a pool no listener serves"));
            }
            if p.tls.is_some()
                && self
                    .listeners
                    .iter()
                    .any(|l| l.mode == Mode::Tcp && l.pool.as_deref() == Some(name.as_str()))
            {
                return bad(format!(
                    "[pool.{name}.tls]: TLS to PEs is for HTTP listeners; a TCP listener \
                     passes its client's bytes (and TLS) through"
                ));
            }
            let serves = |l: &ListenerConfig| {
                l.pool.as_deref() == Some(name.as_str()) || l.routes.iter().any(|r| r.pool == *name)
            };
            if p.tls.is_some()
                && self
                    .listeners
                    .iter()
                    .any(|l| l.kernel_splice() && serves(l))
            {
                return bad(format!(
                    "[pool.{name}.tls]: the kernel splice carries TCP, not TLS to the PEs"
                ));
            }
            if p.protocol == PeProtocol::H2
                && self
                    .listeners
                    .iter()
                    .any(|l| l.mode == Mode::Tcp && l.pool.as_deref() == Some(name.as_str()))
            {
                return bad(format!(
                    "[pool.{name}] protocol = \"h2\" is for HTTP listeners; a TCP listener \
                     passes its client's bytes through"
                ));
            }
            if p.protocol == PeProtocol::H2
                && self
                    .listeners
                    .iter()
                    .any(|l| l.kernel_splice() && serves(l))
            {
                return bad(format!(
                    "[pool.{name}] protocol = \"h2\": the kernel splice pins HTTP/1.1 connections"
                ));
            }
            if let Some(bad_prefix) = p.idempotent.iter().find(|x| !x.starts_with('/')) {
                return bad(format!(
                    "[pool.{name}] idempotent: {bad_prefix:?} must start with /"
                ));
            }
            if p.queue_timeout_ms > 60_000 {
                return bad(format!("pool {name}: queue-timeout-ms above a minute"));
            }
            if p.max_ejection_percent > 100 || p.panic_threshold > 100 {
                return bad(format!(
                    "pool {name}: max-ejection-percent and panic-threshold are percentages (0-100)"
                ));
            }
            if p.max_requests == Some(0) {
                return bad(format!("pool {name}: max-requests must be above 0"));
            }
            if p.max_conn == Some(0) {
                return bad(format!("pool {name}: max-conn must be above 0"));
            }
            // A cookie name is an RFC 6265 token.
            if let Some(c) = &p.sticky_cookie
                && (c.is_empty()
                    || !c
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"-_.!#$%&'*+^`|~".contains(&b)))
            {
                return bad(format!(
                    "pool {name}: sticky-cookie {c:?} is not a cookie name"
                ));
            }
            if !(p.success_rate_stdev_factor.is_finite() && p.success_rate_stdev_factor >= 0.0) {
                return bad(format!(
                    "pool {name}: success-rate-stdev-factor must be 0 or more"
                ));
            }
        }
        if let Some(l) = &self.levels {
            l.validate().map_err(ConfigError::Invalid)?;
        }
        let h = &self.http2;
        if h.max_concurrent_streams == 0
            || h.max_resets_per_s == 0
            || h.max_control_frames_per_s == 0
        {
            return bad(
                "[http2] max-concurrent-streams, max-resets-per-s and max-control-frames-per-s \
                 must be above 0"
                    .into(),
            );
        }
        if h.stream_window < 65_535 || h.connection_window < 65_535 {
            return bad(
                "[http2] stream-window and connection-window must be at least 65535".into(),
            );
        }
        if h.stream_window > (1 << 31) - 1 || h.connection_window > (1 << 31) - 1 {
            return bad("[http2] windows must be below 2^31".into());
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

    /// The settings of one pool.
    pub fn pool_config(&self, handle: &str) -> PoolConfig {
        self.pool_settings.get(handle).cloned().unwrap_or_default()
    }

    pub fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }
}

/// The first TOML example in a module's docs (`src`, the module's source text), for a test
/// that checks the documented example parses.
#[cfg(test)]
pub(crate) fn doc_toml(src: &str) -> String {
    src.lines()
        .skip_while(|l| !l.starts_with("//! ```toml"))
        .skip(1)
        .take_while(|l| !l.starts_with("//! ```"))
        .map(|l| format!("{}\n", l.trim_start_matches("//!").trim_start()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_documented_example_parses() {
        let text = doc_toml(include_str!("mod.rs"));
        let cfg = ProxyConfig::from_toml(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert_eq!(cfg.listeners.len(), 2);
        assert_eq!(cfg.listeners[0].routes[0].pool, "ApiPool");
        assert_eq!(cfg.pools(), ["ApiPool", "EchoPool", "WebPool"]);
        assert_eq!(cfg.pool_config("ApiPool").select, Select::P2c);
        assert_eq!(cfg.pool_config("WebPool"), PoolConfig::default());
    }

    #[test]
    fn mistakes_are_named() {
        let e = ProxyConfig::from_toml("[[listener]]\nlisten = \"127.0.0.1:1\"\nmode = \"tcp\"\n");
        assert!(e.unwrap_err().to_string().contains("needs a pool"));
        let e = ProxyConfig::from_toml("refresh-msec = 5\n");
        assert!(e.unwrap_err().to_string().contains("unknown field"));
        let e = ProxyConfig::from_toml("[pool.A]\nselect = \"fastest\"\n");
        assert!(e.unwrap_err().to_string().contains("unknown variant"));
    }
}
