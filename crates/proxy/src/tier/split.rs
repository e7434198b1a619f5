//! The server's half of a split splice (docs/TIER.md; the TCP splice seed's §2, Tables 6–7): a
//! server of the pool answers the clients of its spliced connections directly, without the
//! proxies. The proxies still splice what the clients send; the server's datapath, attached
//! at egress, rewrites its own answers (addresses, ports, sequence and acknowledgement
//! numbers, SACK, timestamps, window) into what the proxy would have sent.
//!
//! The server joins the proxy tier as a member without ports (registered in the tier's pool
//! handle with `.split`), so every proxy links to it and sends it each splice; it installs
//! those whose server address is its own, and reports FINs, ends and activity of its
//! direction to the proxies, which no longer see those packets. A pool may mix servers with
//! and without a split splice.

use crate::config::TierConfig;
use crate::tier::{Side, Tier, split_pool};
use rserpool_ksplice::{Datapath, Hook, Splice, SpliceState, route_towards};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, SocketAddrV4};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::{debug, info, warn};

/// The server side of split splices on this host.
pub(crate) struct ServerSide {
    dp: Mutex<Datapath>,
    /// The splices installed here, by their server direction (server, back).
    splices: Mutex<HashMap<(SocketAddrV4, SocketAddrV4), Splice>>,
}

impl ServerSide {
    fn dp(&self) -> std::sync::MutexGuard<'_, Datapath> {
        self.dp.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Whether `ip` is an address of this host (binding to it works).
fn local(ip: std::net::Ipv4Addr) -> bool {
    std::net::UdpSocket::bind(SocketAddr::from((ip, 0))).is_ok()
}

impl Side for ServerSide {
    fn install(&self, mut s: Splice) -> Result<(), String> {
        if !local(*s.server.ip()) {
            return Ok(());
        }
        let (_, client_if) = route_towards(*s.client.ip()).map_err(|e| e.to_string())?;
        s.client_if = client_if;
        self.dp()
            .splice_server_side(&s)
            .map_err(|e| e.to_string())?;
        debug!("split splice: {} answers {} directly", s.server, s.client);
        self.splices
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert((s.server, s.back), s);
        Ok(())
    }

    fn remove(&self, s: &Splice) {
        let _ = self.dp().unsplice(s);
        self.splices
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&(s.server, s.back));
    }

    fn mark_fin(&self, from: SocketAddrV4, to: SocketAddrV4) {
        let _ = self.dp().mark_fin(from, to);
    }

    fn touch(&self, flows: &[(SocketAddrV4, SocketAddrV4)]) {
        let mut dp = self.dp();
        for (from, to) in flows {
            let _ = dp.touch(*from, *to);
        }
    }

    fn state(&self) -> Vec<SpliceState> {
        let seen: HashMap<(SocketAddrV4, SocketAddrV4), (bool, u64)> = self
            .dp()
            .directions()
            .unwrap_or_default()
            .into_iter()
            .map(|(from, to, fin, packets)| ((from, to), (fin, packets)))
            .collect();
        let mut splices = self.splices.lock().unwrap_or_else(|p| p.into_inner());
        // Gone from the table (an RST, or expired): forgotten here, and the pass tells the
        // proxies.
        splices.retain(|k, _| seen.contains_key(k));
        splices
            .iter()
            .map(|(k, s)| {
                let (fin, packets) = seen.get(k).copied().unwrap_or_default();
                SpliceState {
                    splice: *s,
                    fin: [false, fin],
                    last_ns: [0, 0],
                    packets: [0, packets],
                }
            })
            .collect()
    }

    fn shares(&self) -> bool {
        false
    }
}

/// Settings of `rserpool split-splice`.
#[derive(Debug, Clone)]
pub struct SplitConfig {
    /// The proxy tier's pool handle.
    pub tier: String,
    /// This server's tier address (links from the proxies), registered in the tier's
    /// `.split` pool.
    pub listen: SocketAddr,
    pub registrars: Vec<rserpool_wire::Address>,
    /// TLS with the registrars, when they run it.
    pub registrar_tls: Option<Arc<rserpool_tls::Tls>>,
    /// Where the answers leave (the datapath is attached at their egress).
    pub interfaces: Vec<String>,
    pub pin_dir: std::path::PathBuf,
    pub max_flows: u32,
    pub idle_timeout: Duration,
    pub fin_timeout: Duration,
}

/// A running server side of split splices.
pub struct SplitServer {
    _tier: Arc<Tier>,
}

impl SplitServer {
    /// Loads the datapath at egress, joins the tier and expires entries as the proxies do.
    pub async fn start(cfg: SplitConfig) -> Result<Self, String> {
        let names: Vec<&str> = cfg.interfaces.iter().map(String::as_str).collect();
        let first = names
            .first()
            .copied()
            .ok_or("split splice: no interface given")?
            .to_string();
        let dp = Datapath::load_at(&names, cfg.max_flows, Path::new(&cfg.pin_dir), Hook::Egress)
            .map_err(|e| format!("split splice: {e}"))?;
        let side = Arc::new(ServerSide {
            dp: Mutex::new(dp),
            splices: Mutex::new(HashMap::new()),
        });
        let IpAddr::V4(addr) = cfg.listen.ip() else {
            return Err("split splice: an IPv4 tier address".into());
        };
        let tier_cfg = TierConfig {
            pool: cfg.tier.clone(),
            listen: cfg.listen,
            server_address: addr,
            ports: String::new(),
            interface: Some(first.clone()),
        };
        let tier = Tier::start_as(
            tier_cfg,
            split_pool(&cfg.tier).to_string(),
            crate::tier::RegistrarAccess {
                addrs: cfg.registrars,
                tls: cfg.registrar_tls,
            },
            side.clone(),
            &first,
            None,
            Box::new(|| 1.0),
            None,
        )
        .await?;
        info!(
            "split splice: answers leave {} directly; member of tier {} at {}",
            cfg.interfaces.join(", "),
            cfg.tier,
            cfg.listen
        );
        let weak = Arc::downgrade(&side);
        let (idle, closing) = (cfg.idle_timeout, cfg.fin_timeout);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(1).min(closing / 2)).await;
                let Some(side) = weak.upgrade() else { return };
                let pass =
                    tokio::task::spawn_blocking(move || side.dp().expire(idle, closing)).await;
                match pass {
                    Ok(Ok(x)) => debug!("split splice: {x:?}"),
                    Ok(Err(e)) => warn!("split splice: expiring entries: {e}"),
                    Err(_) => return,
                }
            }
        });
        Ok(Self { _tier: tier })
    }
}
