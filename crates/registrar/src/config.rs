//! Registrar settings: one list, read from a TOML file (`--config`) and overridden by flags.
//!
//! The [`settings!`] macro writes the list once and derives both the TOML struct ([`Config`])
//! and the command-line overrides ([`ConfigFlags`]), so the two can never drift apart. Keys are
//! the flag names: `keep-alive-interval-ms = 5000` in the file, `--keep-alive-interval-ms 5000`
//! on the command line.

use rserpool_wire::{Address, AddressList};
use std::net::SocketAddr;
use std::path::PathBuf;

macro_rules! settings {
    ($( $(#[doc = $doc:literal])* $name:ident : $ty:ty = $default:expr; )*) => {
        /// Registrar settings. Defaults follow rsplib's registrar where it has one.
        #[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
        #[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
        pub struct Config {
            $( $(#[doc = $doc])* pub $name: $ty, )*
        }

        impl Default for Config {
            fn default() -> Self {
                Self { $( $name: $default, )* }
            }
        }

        /// Command-line overrides of [`Config`]; every field is optional.
        #[derive(Debug, Clone, Default, clap::Args)]
        pub struct ConfigFlags {
            $( $(#[doc = $doc])* #[arg(long)] pub $name: Option<$ty>, )*
        }

        impl ConfigFlags {
            /// Writes every flag that was given over `config`.
            pub fn apply(&self, config: &mut Config) {
                $( if let Some(v) = &self.$name { config.$name = v.clone(); } )*
            }
        }
    };
}

settings! {
    /// ASAP listening addresses: one TCP address (`tcp://`, the default scheme) and any
    /// number of SCTP ones (`sctp+udp://ADDR` for SCTP over UDP port 9899, `sctp://ADDR` for
    /// SCTP on a raw IP socket, which needs root); comma-separated on the command line, a
    /// string or a list in the file.
    asap: AddressList = AddressList::from(Address::tcp(SocketAddr::from(([127, 0, 0, 1], rserpool_wire::ASAP_PORT))));
    /// Status listener (HTTP: `GET /status`, the handlespace as JSON), or `off`. When the
    /// default address is taken (a second registrar on the host), the registrar runs without one.
    status: StatusListen = StatusListen::default();
    /// Registrar ID (Server Identifier); 0 picks a random one at start.
    server_id: u32 = 0;
    /// PEs per HANDLE_RESOLUTION_RESPONSE when the pool user does not say (MaxHResItems).
    max_hres_items: u32 = 3;
    /// Upper bound for a pool user's Handle Resolution Option (also bounded by the message size).
    max_hres_items_requested: u32 = 1024;
    /// PEs a selection may pass over before advancing (rsplib's MaxIncrement; 0 = policy default).
    max_increment: u32 = 0;
    /// Interval between ENDPOINT_KEEP_ALIVEs to a PE this registrar is home for.
    keep_alive_interval_ms: u64 = 5000;
    /// Time for a PE to answer an ENDPOINT_KEEP_ALIVE before it is removed.
    keep_alive_timeout_ms: u64 = 5000;
    /// ENDPOINT_UNREACHABLE reports that remove a PE (MAX-BAD-PE-REPORT).
    max_bad_pe_reports: u32 = 3;
    /// SERVER_ANNOUNCE interval (T6).
    announce_interval_ms: u64 = 1000;
    /// Unicast addresses to send SERVER_ANNOUNCE to (UDP).
    announce: Vec<SocketAddr> = Vec::new();
    /// Also send SERVER_ANNOUNCE to the multicast group.
    announce_multicast: bool = false;
    /// Multicast group and port for SERVER_ANNOUNCE.
    multicast_group: SocketAddr = SocketAddr::from(([239, 0, 0, 1], rserpool_wire::ASAP_PORT));
    /// Handle resolutions per second and pool user connection (0 = unlimited).
    max_hr_rate: u32 = 1000;
    /// ENDPOINT_UNREACHABLE reports per second and pool user connection (0 = unlimited).
    max_eu_rate: u32 = 100;
    /// Re-registrations (policy changes, e.g. load or credit reports) per second and PE
    /// connection; beyond, the PE's lifetime is renewed but its entry stays as it was and
    /// nothing goes to the peers, until the next one within the rate (0 = unlimited).
    max_rereg_rate: u32 = 1000;
    /// Simultaneous ASAP connections.
    max_connections: usize = 100_000;
    /// Pools in the handlespace.
    max_pools: usize = 100_000;
    /// PEs in one pool.
    max_pes_per_pool: usize = 100_000;
    /// PEs in the whole handlespace (all pools, those of peers too): bounds the registrar's
    /// memory against registration floods over many associations.
    max_pes: usize = 100_000;
    /// PEs registered over one connection.
    max_pes_per_connection: usize = 1000;
    /// Longest pool handle, in bytes.
    max_pool_handle_len: usize = 256;
    /// Largest ASAP message accepted; a longer one loses the connection.
    max_message_size: usize = 16384;
    /// Bytes queued for a connection that does not read before it is closed.
    max_pending_bytes: usize = 1 << 20;
    /// ENRP listening addresses: one TCP address (PRESENCE also on UDP at the same address)
    /// and any SCTP ones (`sctp+udp://`, `sctp://`), as for `asap`.
    enrp: AddressList = AddressList::from(Address::tcp(SocketAddr::from(([127, 0, 0, 1], rserpool_wire::ENRP_PORT))));
    /// Peer registrars' ENRP addresses (repeatable; `sctp+udp://ADDR` or `sctp://ADDR` for a
    /// peer reached over SCTP, such as rsplib's registrar); others are found by their
    /// PRESENCE (and reached over TCP).
    peer: Vec<Address> = Vec::new();
    /// Take ENRP connections only from the hosts of `peer` (their IP addresses): without TLS,
    /// the defence against a registrar that is not one of the cluster (RFC 5355 §3.2). Every
    /// registrar of the cluster must then list the others.
    enrp_peers_only: bool = false;
    /// Also send PRESENCE to the multicast group.
    enrp_multicast: bool = false;
    /// Multicast group and port for PRESENCE.
    enrp_multicast_group: SocketAddr = SocketAddr::from(([239, 0, 0, 1], rserpool_wire::ENRP_PORT));
    /// PRESENCE to every peer this often (PEER-HEARTBEAT-CYCLE).
    peer_heartbeat_ms: u64 = 2444;
    /// Silence after which a peer is asked for a PRESENCE with the R bit (MAX-TIME-LAST-HEARD).
    max_time_last_heard_ms: u64 = 5000;
    /// Time for that answer before the peer is taken over (MAX-TIME-NO-RESPONSE).
    max_time_no_response_ms: u64 = 5000;
    /// Time to look for a mentor at start before serving alone.
    mentor_discovery_ms: u64 = 5000;
    /// Time for every peer's INIT_TAKEOVER_ACK before a takeover is given up.
    takeover_expiry_ms: u64 = 5000;
    /// At most one write per peer per this interval: an update after a quiet spell goes out
    /// at once, under load the updates of an interval go out together; 0 = a write per
    /// event-loop wake-up.
    enrp_batch_ms: u64 = 50;
    /// PEs per HANDLE_TABLE_RESPONSE (MaxElementsPerHTRequest).
    max_elements_per_ht_request: usize = 128;
    /// TLS (RFC 5355): this registrar's certificate (PEM). With `tls-key` and `tls-ca`, ASAP
    /// and ENRP are TLS only: peers and PEs must present a certificate from the CA (pool
    /// users may come without one, but cannot register).
    tls_cert: Option<PathBuf> = None;
    /// TLS: the private key of `tls-cert` (PEM).
    tls_key: Option<PathBuf> = None;
    /// TLS: the CA certificate(s) that peers', PEs' and pool users' certificates chain to.
    tls_ca: Option<PathBuf> = None;
    /// Send rsplib's Component Status reports to this monitor (its `cspmonitor` listens on
    /// UDP 2960): the registrar's PEs, pools and peers, every `csp-interval-ms`.
    csp: Option<SocketAddr> = None;
    /// Interval of the component status reports.
    csp_interval_ms: u64 = 1000;
    /// Serve the pools over xDS (the aggregated discovery service, state of the world) on this
    /// address, for Envoy and proxyless gRPC clients (docs/XDS.md). Off by default.
    xds: Option<SocketAddr> = None;
}

/// Where the status listener listens: an address, or `off`. Whether it was given (in the file
/// or on the command line) or is the default matters when the address is taken: a given one
/// must bind, the default may be skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatusListen {
    addr: Option<SocketAddr>,
    given: bool,
}

impl StatusListen {
    /// A given address (`None`: no status listener).
    pub fn given(addr: Option<SocketAddr>) -> Self {
        Self { addr, given: true }
    }

    pub fn addr(&self) -> Option<SocketAddr> {
        self.addr
    }

    /// The default: [`DEFAULT_STATUS`], not given by the user.
    pub fn is_default(&self) -> bool {
        !self.given
    }
}

/// The registrar's status listener by default.
pub const DEFAULT_STATUS: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 8863);

impl Default for StatusListen {
    fn default() -> Self {
        Self {
            addr: Some(DEFAULT_STATUS),
            given: false,
        }
    }
}

impl std::str::FromStr for StatusListen {
    type Err = std::net::AddrParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "off" | "none" => Ok(Self::given(None)),
            _ => s.parse().map(|a| Self::given(Some(a))),
        }
    }
}

impl std::fmt::Display for StatusListen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.addr {
            Some(a) => a.fmt(f),
            None => f.write_str("off"),
        }
    }
}

impl serde::Serialize for StatusListen {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for StatusListen {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(|_| {
            serde::de::Error::custom(format!(
                "expected an address like 127.0.0.1:8863 or \"off\", got {text:?}"
            ))
        })
    }
}

/// The one TCP address of a list of listening addresses.
fn one_tcp(name: &str, list: &AddressList) -> Result<SocketAddr, String> {
    let mut tcp = list.tcp();
    match (tcp.next(), tcp.next()) {
        (Some(a), None) => Ok(a),
        (None, _) => Err(format!(
            "{name} = {:?} has no TCP address; give one (e.g. tcp://127.0.0.1:0) beside the SCTP ones",
            list.to_string()
        )),
        (Some(_), Some(_)) => Err(format!(
            "{name} = {:?} has more than one TCP address; a registrar listens on one",
            list.to_string()
        )),
    }
}

impl Config {
    /// The TCP address of `asap`: there is exactly one (SCTP-only registrars are not built
    /// yet; docs/SCTP.md).
    pub fn asap_tcp(&self) -> Result<SocketAddr, String> {
        one_tcp("asap", &self.asap)
    }

    /// The TCP address of `enrp`, likewise.
    pub fn enrp_tcp(&self) -> Result<SocketAddr, String> {
        one_tcp("enrp", &self.enrp)
    }

    /// The peers' addresses, whatever their transport.
    pub fn peer_addrs(&self) -> impl Iterator<Item = SocketAddr> + '_ {
        self.peer.iter().map(|a| a.addr)
    }

    /// The TLS files, when TLS is on: all three of `tls-cert`, `tls-key` and `tls-ca`, or none.
    pub fn tls_files(&self) -> Result<Option<rserpool_tls::TlsFiles>, String> {
        match (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            (None, None, None) => Ok(None),
            (Some(cert), Some(key), Some(ca)) => Ok(Some(rserpool_tls::TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                ca: ca.clone(),
            })),
            _ => Err("TLS needs all three of tls-cert, tls-key and tls-ca".into()),
        }
    }

    /// The longest a keep-alive's answer may lag behind the end of a silence of the network
    /// (TCP's retransmission back-off), beyond one more timeout: three timeouts
    /// (docs/RELIABILITY.md).
    pub fn keep_alive_wait_limit(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.keep_alive_timeout_ms.saturating_mul(3))
    }

    /// A keep-alive interval and the longest wait for its answer: how long a registrar back
    /// from a cut may still claim PEs that moved to another home meanwhile.
    pub fn taken_over_window(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.keep_alive_interval_ms) + self.keep_alive_wait_limit()
    }

    /// Reads a TOML file; missing keys keep their defaults, unknown keys are an error.
    pub fn from_toml(text: &str) -> Result<Self, toml::de::Error> {
        toml::from_str(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_status_listener_is_an_address_or_off() {
        let default = Config::default().status;
        assert_eq!(
            (default.addr(), default.is_default()),
            (Some(DEFAULT_STATUS), true)
        );
        let c = Config::from_toml("status = \"off\"").unwrap();
        assert_eq!(c.status, StatusListen::given(None));
        // Given explicitly, the default address is no longer the default (it must bind).
        let c = Config::from_toml("status = \"127.0.0.1:8863\"").unwrap();
        assert!(!c.status.is_default());
        let c = Config::from_toml("status = \"127.0.0.1:9000\"").unwrap();
        assert_eq!(c.status.to_string(), "127.0.0.1:9000");
        assert!(Config::from_toml("status = \"nowhere\"").is_err());
        let printed = toml::to_string(&c).unwrap();
        assert_eq!(Config::from_toml(&printed).unwrap(), c);
    }
}
