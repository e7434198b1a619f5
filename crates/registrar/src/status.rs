//! What `rserpool status` shows: the handlespace as one registrar sees it, plus counters.
//! Served as JSON by the registrar on its status listener (`GET /status`) and read back by the
//! CLI.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Status {
    pub server_id: u32,
    pub uptime_ms: u64,
    pub connections: usize,
    pub pool_elements: usize,
    pub pools: Vec<PoolStatus>,
    pub counters: Counters,
    /// ENRP peers (empty without ENRP).
    #[serde(default)]
    pub peers: Vec<PeerStatus>,
    #[serde(default)]
    pub enrp: EnrpCounters,
    /// The xDS server's, when it runs (`xds`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xds: Option<XdsCounters>,
}

/// What the xDS server did (docs/XDS.md).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct XdsCounters {
    pub streams_open: u64,
    pub streams_opened: u64,
    /// Streams refused beyond the limit of open streams.
    pub streams_refused: u64,
    pub responses: u64,
    pub acks: u64,
    /// Responses the clients rejected.
    pub nacks: u64,
    /// Requests for a resource type the server does not serve.
    pub unknown_types: u64,
}

impl XdsCounters {
    fn metrics(&self, m: &mut rserpool_status::metrics::Exposition) {
        m.gauge(
            "rserpool_xds_streams",
            "ADS streams open now.",
            &[],
            self.streams_open as f64,
        );
        let counters = [
            (
                "rserpool_xds_streams_opened",
                "ADS streams opened.",
                self.streams_opened,
            ),
            (
                "rserpool_xds_streams_refused",
                "ADS streams refused beyond the limit of open streams.",
                self.streams_refused,
            ),
            (
                "rserpool_xds_responses",
                "xDS responses sent.",
                self.responses,
            ),
            (
                "rserpool_xds_acks",
                "xDS responses the clients accepted.",
                self.acks,
            ),
            (
                "rserpool_xds_nacks",
                "xDS responses the clients rejected (logged).",
                self.nacks,
            ),
            (
                "rserpool_xds_unknown_types",
                "Requests for a resource type the server does not serve.",
                self.unknown_types,
            ),
        ];
        for (name, help, v) in counters {
            m.counter(name, help, &[], v);
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PoolStatus {
    pub handle: String,
    pub policy: String,
    pub pes: Vec<PeStatus>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PeStatus {
    pub id: u32,
    pub transport: String,
    pub policy: String,
    pub home_registrar: u32,
    pub registration_life: i32,
    /// Time since the last registration or keep-alive ACK.
    pub ms_since_heard: u64,
    pub unreachable_reports: u32,
    pub asap_transport: Option<String>,
}

/// Event counters since start.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Counters {
    pub registrations: u64,
    pub reregistrations: u64,
    pub registrations_rejected: u64,
    pub deregistrations: u64,
    pub deregistrations_rejected: u64,
    pub resolutions: u64,
    pub resolutions_unknown_pool: u64,
    pub resolutions_rate_limited: u64,
    /// Pool users subscribed to a pool's changes (the S bit), now.
    #[serde(default)]
    pub subscriptions: u64,
    /// Pools pushed to subscribers since start.
    #[serde(default)]
    pub subscription_pushes: u64,
    pub keep_alives_sent: u64,
    pub keep_alive_acks: u64,
    pub unreachable_reports: u64,
    pub unreachable_rate_limited: u64,
    /// Re-registrations beyond `max-rereg-rate`: lifetime renewed, entry kept as it was.
    #[serde(default)]
    pub reregistrations_limited: u64,
    /// Associations closed for having a second's worth of requests refused by a rate limit
    /// in a row.
    #[serde(default)]
    pub flooders_closed: u64,
    /// PEs reported unreachable MAX-BAD-PE-REPORT times whose service then answered a probe.
    #[serde(default)]
    pub unreachable_refuted: u64,
    pub removed_keep_alive_timeout: u64,
    /// Keep-alive timeouts that did not remove their PE yet, because the network had shown
    /// nothing meanwhile (this registrar may have been the one cut off) or the answer may
    /// still lag behind a dark spell.
    #[serde(default)]
    pub keep_alive_timeouts_held: u64,
    /// Keep-alive timeouts that did not remove their PE yet, because the keep-alive was still
    /// on its way (TCP had not delivered it, or retransmitted lately over that connection).
    #[serde(default)]
    pub keep_alive_timeouts_held_on_lossy_path: u64,
    /// PEs lost (association closed, keep-alive unanswered) soon after a takeover of this
    /// registrar, or a silence long enough for one: kept as the new home's, not removed.
    #[serde(default)]
    pub kept_after_takeover: u64,
    /// PEs taken over from a registrar that came back, which stayed with it (they refused
    /// the takeover, or it did not reach them): given back rather than removed.
    #[serde(default)]
    pub takeovers_handed_back: u64,
    pub removed_connection_closed: u64,
    pub removed_unreachable: u64,
    pub removed_lifetime_expired: u64,
    pub protocol_errors: u64,
    pub connections_refused: u64,
    pub slow_connections_closed: u64,
    /// TLS handshakes refused (no or a foreign certificate, or not TLS at all).
    #[serde(default)]
    pub tls_refused: u64,
    /// Error causes sent in ERRORs and refusing responses, by cause code (`0x9`, …).
    #[serde(default)]
    pub errors_sent: std::collections::BTreeMap<String, u64>,
}

/// ENRP event counters (part of `rserpool status`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct EnrpCounters {
    pub updates_sent: u64,
    pub updates_received: u64,
    pub audits: u64,
    pub takeovers: u64,
    pub pes_taken_over: u64,
    pub takeovers_aborted: u64,
    /// Takeovers not started because this registrar may be the one cut off: it is in a silence
    /// of the network or just back from one, or no other peer is there to agree and the
    /// network was not heard both just before the peer was asked for a PRESENCE and since.
    #[serde(default)]
    pub takeovers_deferred: u64,
    pub handle_table_blocks_sent: u64,
    pub handle_table_entries_received: u64,
    /// HANDLE_UPDATEs that named this registrar home of a PE not registered here: removed
    /// everywhere with a DEL_PE.
    #[serde(default)]
    pub disowned: u64,
}

/// One peer as `rserpool status` shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PeerStatus {
    pub id: u32,
    pub address: String,
    pub ms_since_heard: u64,
    pub state: String,
    pub connected: bool,
    /// The checksum the peer announced for its own PEs.
    pub checksum: Option<u16>,
    /// Whether that matches this registrar's view of the peer's PEs.
    pub checksum_agrees: Option<bool>,
    pub pes_owned: usize,
}

/// Pool series at most; the PEs of the remaining pools are summed under `pool="other"`.
pub const MAX_POOL_SERIES: usize = 1000;

/// What the registrar's `GET /metrics` reads from one moment of the core: counters and sizes,
/// nothing per PE, so that a scrape costs the event loop next to nothing however many PEs
/// there are (the status document formats every PE).
#[derive(Debug, Clone)]
pub struct MetricsView {
    pub server_id: u32,
    pub connections: usize,
    /// Every pool's handle and its number of PEs.
    pub pool_sizes: Vec<(String, usize)>,
    /// PEs this registrar is home for.
    pub home_pes: usize,
    pub counters: Counters,
    pub enrp: EnrpCounters,
    pub peers: Vec<PeerStatus>,
    pub xds: Option<XdsCounters>,
}

impl MetricsView {
    /// The registrar's `GET /metrics`. Cardinality: one series per pool (up to
    /// [`MAX_POOL_SERIES`]), per ENRP peer and per error cause sent; none per PE.
    pub fn metrics(&self) -> rserpool_status::metrics::Exposition {
        let mut m = rserpool_status::metrics::Exposition::default();
        let id = format!("{:#010x}", self.server_id);
        m.gauge(
            "rserpool_registrar_info",
            "The registrar's server identifier (always 1).",
            &[("server_id", &id)],
            1.0,
        );
        m.gauge(
            "rserpool_registrar_connections",
            "ASAP and ENRP connections open now.",
            &[],
            self.connections as f64,
        );
        m.gauge(
            "rserpool_registrar_pools",
            "Pools in the handlespace.",
            &[],
            self.pool_sizes.len() as f64,
        );
        m.gauge(
            "rserpool_registrar_home_pool_elements",
            "PEs whose home registrar this is.",
            &[],
            self.home_pes as f64,
        );
        let help = "PEs registered in the pool (all registrars' PEs).";
        let sizes = &self.pool_sizes;
        let (named, rest) = sizes.split_at(sizes.len().min(MAX_POOL_SERIES));
        for (handle, n) in named {
            let labels = [("pool", handle.as_str())];
            m.gauge("rserpool_registrar_pool_elements", help, &labels, *n as f64);
        }
        if !rest.is_empty() {
            let n: usize = rest.iter().map(|(_, n)| n).sum();
            m.gauge(
                "rserpool_registrar_pool_elements",
                help,
                &[("pool", "other")],
                n as f64,
            );
        }
        self.counters.metrics(&mut m);
        self.enrp.metrics(&mut m);
        if let Some(x) = &self.xds {
            x.metrics(&mut m);
        }
        let peers = "ENRP peers";
        for p in &self.peers {
            let peer = format!("{:#010x}", p.id);
            let labels = [("peer", peer.as_str())];
            m.gauge(
                "rserpool_enrp_peer_connected",
                &format!("{peers}: 1 while connected."),
                &labels,
                f64::from(u8::from(p.connected)),
            );
            m.gauge(
                "rserpool_enrp_peer_last_heard_seconds",
                &format!("{peers}: time since the peer was last heard."),
                &labels,
                p.ms_since_heard as f64 / 1e3,
            );
            m.gauge(
                "rserpool_enrp_peer_pool_elements",
                &format!("{peers}: PEs the peer is home registrar of."),
                &labels,
                p.pes_owned as f64,
            );
            if let Some(agrees) = p.checksum_agrees {
                m.gauge(
                    "rserpool_enrp_peer_checksum_agrees",
                    &format!("{peers}: 1 when the peer's checksum matches our view of its PEs."),
                    &labels,
                    f64::from(u8::from(agrees)),
                );
            }
        }
        rserpool_status::metrics::process(&mut m);
        m
    }
}

impl Counters {
    fn metrics(&self, m: &mut rserpool_status::metrics::Exposition) {
        let counters = [
            (
                "rserpool_registrar_registrations",
                "Registrations accepted (first ones).",
                self.registrations,
            ),
            (
                "rserpool_registrar_reregistrations",
                "Re-registrations accepted (updates of a registered PE).",
                self.reregistrations,
            ),
            (
                "rserpool_registrar_registrations_rejected",
                "Registrations refused.",
                self.registrations_rejected,
            ),
            (
                "rserpool_registrar_deregistrations",
                "Deregistrations accepted.",
                self.deregistrations,
            ),
            (
                "rserpool_registrar_deregistrations_rejected",
                "Deregistrations refused.",
                self.deregistrations_rejected,
            ),
            (
                "rserpool_registrar_resolutions",
                "Handle resolutions answered.",
                self.resolutions,
            ),
            (
                "rserpool_registrar_resolutions_unknown_pool",
                "Handle resolutions of a pool that does not exist.",
                self.resolutions_unknown_pool,
            ),
            (
                "rserpool_registrar_resolutions_rate_limited",
                "Handle resolutions refused by the rate limit.",
                self.resolutions_rate_limited,
            ),
            (
                "rserpool_registrar_subscription_pushes",
                "Pools pushed to subscribed pool users.",
                self.subscription_pushes,
            ),
            (
                "rserpool_registrar_keep_alives_sent",
                "ENDPOINT_KEEP_ALIVEs sent to PEs.",
                self.keep_alives_sent,
            ),
            (
                "rserpool_registrar_keep_alive_acks",
                "ENDPOINT_KEEP_ALIVE_ACKs received.",
                self.keep_alive_acks,
            ),
            (
                "rserpool_registrar_keep_alive_timeouts_held",
                "Keep-alive timeouts that did not remove their PE yet: the network had shown nothing meanwhile.",
                self.keep_alive_timeouts_held,
            ),
            (
                "rserpool_registrar_keep_alive_timeouts_held_on_lossy_path",
                "Keep-alive timeouts that did not remove their PE yet: TCP had not delivered the keep-alive, or retransmitted lately over its connection.",
                self.keep_alive_timeouts_held_on_lossy_path,
            ),
            (
                "rserpool_registrar_kept_after_takeover",
                "PEs lost just after a takeover of this registrar (or a silence long enough for one), kept as the new home's.",
                self.kept_after_takeover,
            ),
            (
                "rserpool_registrar_takeovers_handed_back",
                "PEs taken over from a registrar that came back and stayed with it, given back rather than removed.",
                self.takeovers_handed_back,
            ),
            (
                "rserpool_registrar_unreachable_reports",
                "ENDPOINT_UNREACHABLE reports received.",
                self.unreachable_reports,
            ),
            (
                "rserpool_registrar_unreachable_rate_limited",
                "ENDPOINT_UNREACHABLE reports ignored by the rate limit.",
                self.unreachable_rate_limited,
            ),
            (
                "rserpool_registrar_reregistrations_limited",
                "Re-registrations beyond max-rereg-rate: the PE's lifetime renewed, its entry \
                 kept as it was, nothing sent to the peers.",
                self.reregistrations_limited,
            ),
            (
                "rserpool_registrar_flooders_closed",
                "Associations closed for having a second's worth of requests refused by a rate \
                 limit in a row.",
                self.flooders_closed,
            ),
            (
                "rserpool_registrar_unreachable_refuted",
                "PEs reported unreachable MAX-BAD-PE-REPORT times whose service answered the \
                 registrar's own connection: kept.",
                self.unreachable_refuted,
            ),
            (
                "rserpool_registrar_protocol_errors",
                "Malformed or unexpected messages received.",
                self.protocol_errors,
            ),
            (
                "rserpool_registrar_connections_refused",
                "Connections refused at the connection limit.",
                self.connections_refused,
            ),
            (
                "rserpool_registrar_slow_connections_closed",
                "Connections closed because they took none of our bytes in time.",
                self.slow_connections_closed,
            ),
            (
                "rserpool_registrar_tls_refused",
                "TLS handshakes refused (no or a foreign certificate, or not TLS).",
                self.tls_refused,
            ),
        ];
        for (name, help, v) in counters {
            m.counter(name, help, &[], v);
        }
        let removals = [
            ("keep_alive_timeout", self.removed_keep_alive_timeout),
            ("connection_closed", self.removed_connection_closed),
            ("unreachable", self.removed_unreachable),
            ("lifetime_expired", self.removed_lifetime_expired),
        ];
        for (reason, v) in removals {
            m.counter(
                "rserpool_registrar_pool_element_removals",
                "PEs removed from the handlespace, by reason.",
                &[("reason", reason)],
                v,
            );
        }
        m.gauge(
            "rserpool_registrar_subscriptions",
            "Pool users subscribed to a pool's changes now.",
            &[],
            self.subscriptions as f64,
        );
        for (cause, v) in &self.errors_sent {
            let name = u16::from_str_radix(cause.trim_start_matches("0x"), 16)
                .ok()
                .and_then(|c| rserpool_wire::CauseCode(c).name())
                .unwrap_or("unknown");
            m.counter(
                "rserpool_registrar_errors_sent",
                "Error causes sent in ERRORs and refusing responses, by RFC 5354 cause code.",
                &[("cause", cause), ("name", name)],
                *v,
            );
        }
    }
}

impl EnrpCounters {
    fn metrics(&self, m: &mut rserpool_status::metrics::Exposition) {
        let counters = [
            (
                "rserpool_enrp_handle_updates_sent",
                "HANDLE_UPDATEs sent to peers.",
                self.updates_sent,
            ),
            (
                "rserpool_enrp_handle_updates_received",
                "HANDLE_UPDATEs received from peers.",
                self.updates_received,
            ),
            (
                "rserpool_enrp_audits",
                "Checksum audits that found a disagreement and synchronised.",
                self.audits,
            ),
            (
                "rserpool_enrp_takeovers",
                "Takeovers of a dead peer's PEs completed by this registrar.",
                self.takeovers,
            ),
            (
                "rserpool_enrp_pool_elements_taken_over",
                "PEs taken over from dead peers.",
                self.pes_taken_over,
            ),
            (
                "rserpool_enrp_takeovers_aborted",
                "Takeovers given up (the peer answered, or another won).",
                self.takeovers_aborted,
            ),
            (
                "rserpool_enrp_takeovers_deferred",
                "Takeovers not started because this registrar may be the one cut off: it is in a silence of the network or just back from one, or no other peer is there to agree and the network (a PE, a connection closed by its other end) was not heard both just before the peer was asked for a PRESENCE and since.",
                self.takeovers_deferred,
            ),
            (
                "rserpool_enrp_handle_table_blocks_sent",
                "HANDLE_TABLE_RESPONSE blocks sent.",
                self.handle_table_blocks_sent,
            ),
            (
                "rserpool_enrp_handle_table_entries_received",
                "PEs received in HANDLE_TABLE_RESPONSEs.",
                self.handle_table_entries_received,
            ),
            (
                "rserpool_enrp_pool_elements_disowned",
                "HANDLE_UPDATEs that named this registrar home of a PE not registered here, answered with a DEL_PE.",
                self.disowned,
            ),
        ];
        for (name, help, v) in counters {
            m.counter(name, help, &[], v);
        }
    }
}
