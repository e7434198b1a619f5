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
    pub removed_keep_alive_timeout: u64,
    pub removed_connection_closed: u64,
    pub removed_unreachable: u64,
    pub removed_lifetime_expired: u64,
    pub protocol_errors: u64,
    pub connections_refused: u64,
    pub slow_connections_closed: u64,
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
    pub handle_table_blocks_sent: u64,
    pub handle_table_entries_received: u64,
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
