//! A proxy's side of a hand-over (`rserpool_handover`): what a running proxy gives the process
//! that replaces it — its client listeners and its status listener, named by their configured
//! addresses, and a tier member's sockets and registration (`tier::TierState`) — and how that
//! process finds them again, so that an upgrade or a restart has no
//! moment in which nobody listens (docs/OPERATIONS.md, "Upgrading without a refused
//! connection").

use crate::tier::{TakenMember, TierState};
use rserpool_handover::{Error, Giving, Offer, Taken};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::time::Duration;
use tracing::warn;

/// Longest a new process may take from taking the sockets to accepting on them (loading the
/// kernel splice and joining a tier included); the running one serves meanwhile.
pub const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// What the descriptors of a hand-over are, in their order: listeners first, then the status
/// listener, then the tier member's (see [`TierState`]).
#[derive(Serialize, Deserialize, Default)]
pub(crate) struct State {
    pub(crate) listeners: Vec<SocketAddr>,
    pub(crate) status: Option<SocketAddr>,
    #[serde(default)]
    pub(crate) tier: Option<TierState>,
}

/// Listening sockets taken from a running proxy, by the address each is configured with, and
/// its tier membership.
#[derive(Default)]
pub struct Inherited {
    pub(crate) listeners: HashMap<SocketAddr, std::net::TcpListener>,
    pub(crate) status: Option<(SocketAddr, std::net::TcpListener)>,
    pub(crate) tier: Option<TakenMember>,
}

impl Inherited {
    /// The sockets `taken` carries (which leaves it without them).
    pub fn from_taken(taken: &mut Taken) -> Result<Inherited, String> {
        let state: State = serde_json::from_slice(&taken.state)
            .map_err(|e| format!("the running proxy's hand-over state: {e}"))?;
        let tier_fds = state
            .tier
            .as_ref()
            .map_or(0, |t| 2 + usize::from(t.registration.is_some()));
        let want = state.listeners.len() + usize::from(state.status.is_some()) + tier_fds;
        if want != taken.fds.len() {
            return Err(format!(
                "the running proxy named {want} sockets and handed over {}",
                taken.fds.len()
            ));
        }
        let mut fds = std::mem::take(&mut taken.fds).into_iter();
        let mut next = |what: &SocketAddr| -> Result<std::net::TcpListener, String> {
            let fd = fds.next().ok_or("a socket is missing")?;
            rserpool_handover::tcp_listener(fd, &what.to_string()).map_err(|e| e.to_string())
        };
        let mut inherited = Inherited::default();
        for a in &state.listeners {
            let l = next(a)?;
            inherited.listeners.insert(*a, l);
        }
        if let Some(a) = state.status {
            inherited.status = Some((a, next(&a)?));
        }
        if let Some(t) = state.tier {
            let mut fd = || fds.next().ok_or("a socket of the tier is missing");
            let tcp = rserpool_handover::tcp_listener(fd()?, &t.listen.to_string())
                .map_err(|e| e.to_string())?;
            let udp = std::net::UdpSocket::from(fd()?);
            let registration = match &t.registration {
                Some(r) => Some((r.handed_over(t.id), std::net::TcpStream::from(fd()?))),
                None => None,
            };
            inherited.tier = Some(TakenMember {
                listen: t.listen,
                tcp,
                udp,
                id: t.id,
                registration,
                pe: None,
            });
        }
        Ok(inherited)
    }

    pub fn is_empty(&self) -> bool {
        self.listeners.is_empty() && self.status.is_none() && self.tier.is_none()
    }
}

/// Waits for a new process at `offer`, gives it what `sockets` returns (the state and the
/// descriptors) and returns once it accepts on them: the caller then stops accepting and says
/// [`Giving::done`]. A new process that fails or gives up is logged, `failed` is called (to
/// take back what cannot be shared, such as a registration), and the wait goes on.
pub async fn next_successor<F>(
    offer: &Offer,
    sockets: impl Fn() -> F,
    failed: impl Fn(),
) -> std::io::Result<Giving>
where
    F: std::future::Future<Output = std::io::Result<(Vec<u8>, Vec<OwnedFd>)>>,
{
    let listener = tokio::net::UnixListener::from_std(offer.listener().try_clone()?)?;
    loop {
        let (stream, _) = listener.accept().await?;
        let stream = stream.into_std()?;
        let (state, fds) = match sockets().await {
            Ok(s) => s,
            Err(e) => {
                warn!("proxy: cannot hand over: {e}");
                continue;
            }
        };
        let addr = offer.address().clone();
        let given = tokio::task::spawn_blocking(move || -> Result<(u32, Giving), Error> {
            let asker = rserpool_handover::Asker::new(&addr, stream)?;
            let pid = asker.pid;
            let giving = asker.give(&state, &rserpool_handover::borrow(&fds))?;
            giving.wait_ready(READY_TIMEOUT)?;
            Ok((pid, giving))
        })
        .await
        .map_err(std::io::Error::other)?;
        match given {
            Ok((pid, giving)) => {
                tracing::info!("proxy: process {pid} took over the listeners");
                return Ok(giving);
            }
            Err(e) => {
                warn!("proxy: a hand-over did not complete, serving on: {e}");
                failed();
            }
        }
    }
}
