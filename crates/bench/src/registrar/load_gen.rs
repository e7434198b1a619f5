//! The load generator of the registrar benchmark, run as a separate process
//! (`rserpool-bench load-gen`, hidden) so that its CPU is not the registrar's: N simulated PEs
//! re-registering and M simulated PUs resolving, each on its own TCP connection (or K PEs on
//! one, `--pes-per-connection`, where N connections would not fit the descriptor limit; RFC
//! 5352 has a PE per association, rserpool's registrar takes up to `max-pes-per-connection`).
//! It prints
//! `start` and `stop` around the measurement window, then its result as one JSON line.

use crate::process::raise_nofile_limit;
use anyhow::{Result, bail};
use clap::Args;
use rserpool_asap::AsapConnection;
use rserpool_wire::{AsapMessage, Policy, PoolHandle, TransportAddress, UserTransport};
use serde::{Deserialize, Serialize};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::TcpSocket;

/// PEs per pool in the simulated handlespace.
const POOL_SIZE: usize = 100;
/// Connections per loopback source address (the ephemeral port range holds ~28,000).
const CONNS_PER_SOURCE: usize = 20_000;

#[derive(Args, Debug, Clone)]
pub struct LoadGenArgs {
    /// The registrar's ASAP address; `sctp+udp://ADDR` for SCTP over UDP.
    #[arg(long)]
    pub registrar: rserpool_wire::Address,
    #[arg(long)]
    pub pes: usize,
    #[arg(long)]
    pub rereg_ms: u64,
    /// PEs sharing one connection (each re-registering every `rereg_ms`).
    #[arg(long, default_value_t = 1)]
    pub pes_per_connection: usize,
    #[arg(long)]
    pub pus: usize,
    #[arg(long)]
    pub resolve_ms: u64,
    #[arg(long)]
    pub warmup_ms: u64,
    #[arg(long)]
    pub duration_ms: u64,
    /// The PEs' service address is this IP (port 1024 + PE number) instead of one of 10/8 per
    /// PE: rsplib's registrar accepts only addresses of the registering association.
    #[arg(long)]
    pub user_ip: Option<Ipv4Addr>,
    /// TLS: the PEs and PUs present DIR/pe.pem (key DIR/pe.key) and trust DIR/ca.pem.
    #[arg(long, value_name = "DIR")]
    pub tls_dir: Option<std::path::PathBuf>,
}

#[derive(Debug, Serialize, Deserialize)]
pub(super) struct GenResult {
    pub(super) p50_us: u64,
    pub(super) p99_us: u64,
    pub(super) answered: u64,
    pub(super) seconds: f64,
    pub(super) errors: u64,
}

struct Shared {
    measuring: AtomicBool,
    latencies: Mutex<Vec<u32>>,
    answered: AtomicU64,
    errors: AtomicU64,
}

impl Shared {
    fn record(&self, t0: Instant) {
        if self.measuring.load(Ordering::Relaxed) {
            let us = t0.elapsed().as_micros().min(u128::from(u32::MAX)) as u32;
            if let Ok(mut l) = self.latencies.lock() {
                l.push(us);
            }
            self.answered.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The simulated PEs and PUs (a separate process, so its CPU is not the registrar's).
pub fn run(args: LoadGenArgs) -> Result<()> {
    raise_nofile_limit(200_000);
    let rt = rserpool::util::runtime()?;
    rt.block_on(async move {
        let shared = Arc::new(Shared {
            measuring: AtomicBool::new(false),
            latencies: Mutex::new(Vec::new()),
            answered: AtomicU64::new(0),
            errors: AtomicU64::new(0),
        });
        // Connect and register everyone first, a bounded number at a time.
        let gate = Arc::new(tokio::sync::Semaphore::new(256));
        let tls = args
            .tls_dir
            .as_deref()
            .map(tls_of)
            .transpose()?
            .map(Arc::new);
        let mut setup = tokio::task::JoinSet::new();
        let per = args.pes_per_connection.max(1);
        let pe_conns = args.pes.div_ceil(per);
        for c in 0..pe_conns + args.pus {
            let gate = gate.clone();
            let reg = args.registrar;
            let tls = tls.clone();
            // Connection `c` carries PEs `pes` (none for a PU's).
            let pes = if c < pe_conns {
                c * per..((c + 1) * per).min(args.pes)
            } else {
                0..0
            };
            setup.spawn(async move {
                let _permit = gate.acquire().await;
                let mut conn = connect(reg, c, tls.as_deref()).await?;
                for i in pes.clone() {
                    conn.send(&registration(i, 0, args.user_ip)).await?;
                    loop {
                        if let AsapMessage::RegistrationResponse { reject, .. } =
                            conn.recv().await?
                        {
                            if reject {
                                bail!("registration {i} rejected");
                            }
                            break;
                        }
                    }
                }
                Ok::<_, anyhow::Error>((c, pes, conn))
            });
        }
        let mut conns = Vec::with_capacity(pe_conns + args.pus);
        while let Some(r) = setup.join_next().await {
            conns.push(r??);
        }
        let pools = args.pes.div_ceil(POOL_SIZE).max(1);
        for (c, pes, conn) in conns {
            let shared = shared.clone();
            if c < pe_conns {
                tokio::spawn(pe_task(pes, conn, args.rereg_ms, args.user_ip, shared));
            } else {
                // Numbered after the PEs, as when every PE had a connection.
                let i = args.pes + (c - pe_conns);
                tokio::spawn(pu_task(i, conn, args.resolve_ms, pools, shared));
            }
        }
        tokio::time::sleep(Duration::from_millis(args.warmup_ms)).await;
        println!("start");
        shared.measuring.store(true, Ordering::Relaxed);
        let t0 = Instant::now();
        tokio::time::sleep(Duration::from_millis(args.duration_ms)).await;
        shared.measuring.store(false, Ordering::Relaxed);
        let seconds = t0.elapsed().as_secs_f64();
        println!("stop");
        let mut l = shared
            .latencies
            .lock()
            .map(|l| l.clone())
            .unwrap_or_default();
        l.sort_unstable();
        let pct = |q: f64| {
            l.get(((l.len() as f64 * q) as usize).min(l.len().saturating_sub(1)))
                .copied()
                .unwrap_or(0)
        };
        let r = GenResult {
            p50_us: u64::from(pct(0.50)),
            p99_us: u64::from(pct(0.99)),
            answered: shared.answered.load(Ordering::Relaxed),
            seconds,
            errors: shared.errors.load(Ordering::Relaxed),
        };
        println!("{}", serde_json::to_string(&r)?);
        Ok::<_, anyhow::Error>(())
    })?;
    // Skip tearing down tens of thousands of connections one by one.
    std::process::exit(0)
}

async fn connect(
    reg: rserpool_wire::Address,
    i: usize,
    tls: Option<&rserpool_tls::Tls>,
) -> Result<AsapConnection> {
    if reg.scheme.is_sctp() {
        // All associations behind the process's one SCTP socket.
        return Ok(AsapConnection::connect_to(&reg, Duration::from_secs(30)).await?);
    }
    let reg = reg.addr;
    let source = Ipv4Addr::new(127, 0, 0, 1 + (i / CONNS_PER_SOURCE) as u8);
    let sock = TcpSocket::new_v4()?;
    // Reset instead of FIN at exit: no TIME_WAIT holding ports the next point needs.
    sock.set_zero_linger()?;
    sock.bind(SocketAddr::from((source, 0)))?;
    let stream = sock.connect(reg).await?;
    stream.set_nodelay(true)?;
    Ok(match tls {
        Some(t) => AsapConnection::from_io(t.connect_stream(reg.ip(), stream).await?, reg),
        None => AsapConnection::from_stream(stream, reg),
    })
}

/// The load generator's TLS identity, from `--tls-dir`.
pub(super) fn tls_of(dir: &std::path::Path) -> Result<rserpool_tls::Tls> {
    Ok(rserpool_tls::Tls::load(&rserpool_tls::TlsFiles {
        cert: dir.join("pe.pem"),
        key: dir.join("pe.key"),
        ca: dir.join("ca.pem"),
    })?)
}

fn registration(i: usize, round: u64, user_ip: Option<Ipv4Addr>) -> AsapMessage {
    // A new load each time, so every re-registration moves the PE in its pool's LU order.
    let load = ((i as u64)
        .wrapping_mul(2_654_435_761)
        .wrapping_add(round * 40_503)
        % 1000) as f64
        / 1000.0;
    AsapMessage::Registration {
        pool_handle: PoolHandle::from(format!("pool-{}", i / POOL_SIZE).as_str()),
        pool_element: rserpool_wire::PoolElement {
            id: i as u32 + 1,
            home_registrar: 0,
            registration_life: 60,
            user_transport: UserTransport::Address(TransportAddress::tcp(match user_ip {
                Some(ip) => SocketAddr::from((ip, 1024 + (i % 60_000) as u16)),
                None => SocketAddr::from((
                    Ipv4Addr::new(10, (i >> 16) as u8, (i >> 8) as u8, i as u8),
                    8000,
                )),
            })),
            policy: Policy::LeastUsed {
                load: rserpool_wire::policy::load_from_fraction(load),
            },
            asap_transport: None,
        },
    }
}

/// Spreads the first request of each simulated endpoint over one period.
fn phase(i: usize, period_ms: u64) -> Duration {
    Duration::from_millis((i as u64).wrapping_mul(7919) % period_ms.max(1))
}

/// PEs `pes` on one connection, each re-registering every `period_ms` (in turn, evenly
/// spread over the period).
async fn pe_task(
    pes: std::ops::Range<usize>,
    mut conn: AsapConnection,
    period_ms: u64,
    user_ip: Option<Ipv4Addr>,
    shared: Arc<Shared>,
) {
    let count = pes.len().max(1) as u32;
    let period = Duration::from_millis(period_ms.max(1)) / count;
    // The first turn within the first tick: every connection is busy from the start.
    let tick_ms = (period_ms / u64::from(count)).max(1);
    let start = tokio::time::Instant::now() + phase(pes.start, tick_ms);
    let mut tick = tokio::time::interval_at(start, period.max(Duration::from_micros(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut turn = 0u64;
    loop {
        tick.tick().await;
        turn += 1;
        let i = pes.start + (turn % u64::from(count)) as usize;
        let round = turn / u64::from(count);
        let t0 = Instant::now();
        if conn.send(&registration(i, round, user_ip)).await.is_err() {
            shared.errors.fetch_add(1, Ordering::Relaxed);
            return;
        }
        loop {
            match conn.recv().await {
                Ok(AsapMessage::RegistrationResponse { reject, .. }) => {
                    if reject {
                        shared.errors.fetch_add(1, Ordering::Relaxed);
                    }
                    shared.record(t0);
                    break;
                }
                Ok(AsapMessage::EndpointKeepAlive {
                    pool_handle, pe_id, ..
                }) => {
                    let ack = AsapMessage::EndpointKeepAliveAck {
                        pool_handle,
                        pe_id: pe_id.unwrap_or(i as u32 + 1),
                    };
                    let _ = conn.send(&ack).await;
                }
                Ok(_) => {}
                Err(_) => {
                    shared.errors.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            }
        }
    }
}

async fn pu_task(
    i: usize,
    mut conn: AsapConnection,
    period_ms: u64,
    pools: usize,
    shared: Arc<Shared>,
) {
    let period = Duration::from_millis(period_ms.max(1));
    let mut tick =
        tokio::time::interval_at(tokio::time::Instant::now() + phase(i, period_ms), period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut round = 0usize;
    loop {
        tick.tick().await;
        round += 1;
        let pool = (i + round) % pools;
        let msg = AsapMessage::HandleResolution {
            subscribe: false,
            pool_handle: PoolHandle::from(format!("pool-{pool}").as_str()),
            items: None,
        };
        let t0 = Instant::now();
        if conn.send(&msg).await.is_err() {
            shared.errors.fetch_add(1, Ordering::Relaxed);
            return;
        }
        match conn.recv().await {
            Ok(AsapMessage::HandleResolutionResponse { error, .. }) => {
                if error.is_some() {
                    shared.errors.fetch_add(1, Ordering::Relaxed);
                }
                shared.record(t0);
            }
            _ => {
                shared.errors.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
    }
}
