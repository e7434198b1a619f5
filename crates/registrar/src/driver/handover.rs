//! A registrar's side of a hand-over (`rserpool_handover`, docs/OPERATIONS.md): a new process
//! started with the configuration of a running one takes its listening sockets (ASAP, ENRP over
//! TCP and UDP, status), its Server Identifier and its ASAP associations — each connection's
//! socket with its registrations and subscriptions ([`Adoptable`]) — so that no PE registers
//! again and no resolution is refused. TLS associations cannot be passed on (their session
//! state lives in the process): they are closed and their PEs register with the new process.

use crate::core::Adoptable;
use rserpool_handover::{Address, Taken};
use serde::{Deserialize, Serialize};
use std::io;
use std::os::fd::OwnedFd;

/// What the descriptors of a hand-over are, in their order: the ASAP listener, then ENRP's
/// TCP listener and UDP socket, then the status listener, then one per association.
#[derive(Serialize, Deserialize)]
pub(super) struct State {
    pub(super) server_id: u32,
    pub(super) enrp: bool,
    pub(super) status: bool,
    pub(super) conns: Vec<Adoptable>,
    /// The PEs other registrars are home for ([`crate::core::Registrar::peer_pes`]).
    pub(super) peer_pes: Vec<u8>,
}

/// What a new registrar took over from a running one.
pub struct Inherited {
    pub(super) server_id: u32,
    pub(super) asap: std::net::TcpListener,
    pub(super) enrp: Option<(std::net::TcpListener, std::net::UdpSocket)>,
    pub(super) status: Option<std::net::TcpListener>,
    pub(super) conns: Vec<(Adoptable, std::net::TcpStream)>,
    pub(super) peer_pes: Vec<u8>,
    /// Told once the new process serves.
    pub(super) taken: Taken,
}

impl Inherited {
    /// Asks the registrar offering at `addr` for its sockets and state; `Ok(None)` when none
    /// offers.
    pub fn take(addr: &Address) -> io::Result<Option<Inherited>> {
        let Some(mut taken) = rserpool_handover::take(addr).map_err(io::Error::other)? else {
            return Ok(None);
        };
        let state: State = serde_json::from_slice(&taken.state).map_err(io::Error::other)?;
        let want = 1 + 2 * usize::from(state.enrp) + usize::from(state.status) + state.conns.len();
        if want != taken.fds.len() {
            return Err(io::Error::other(format!(
                "the running registrar named {want} sockets and handed over {}",
                taken.fds.len()
            )));
        }
        let mut fds = std::mem::take(&mut taken.fds).into_iter();
        let mut next = || {
            fds.next()
                .ok_or_else(|| io::Error::other("a socket is missing"))
        };
        let asap = rserpool_handover::tcp_listener(next()?, "ASAP")?;
        let enrp = if state.enrp {
            let tcp = rserpool_handover::tcp_listener(next()?, "ENRP")?;
            let udp = std::net::UdpSocket::from(next()?);
            udp.local_addr()?;
            Some((tcp, udp))
        } else {
            None
        };
        let status = if state.status {
            Some(rserpool_handover::tcp_listener(next()?, "status")?)
        } else {
            None
        };
        let mut conns = Vec::with_capacity(state.conns.len());
        for a in state.conns {
            let s = std::net::TcpStream::from(next()?);
            s.set_nonblocking(true)?;
            conns.push((a, s));
        }
        for l in [&asap].into_iter().chain(status.as_ref()) {
            l.set_nonblocking(true)?;
        }
        if let Some((l, u)) = &enrp {
            l.set_nonblocking(true)?;
            u.set_nonblocking(true)?;
        }
        Ok(Some(Inherited {
            server_id: state.server_id,
            asap,
            enrp,
            status,
            conns,
            peer_pes: state.peer_pes,
            taken,
        }))
    }

    /// The running registrar's process.
    pub fn pid(&self) -> u32 {
        self.taken.pid
    }
}

/// The state for `conns`, and the descriptors in its order.
pub(super) fn state(
    server_id: u32,
    listeners: Vec<OwnedFd>,
    enrp: bool,
    status: bool,
    conns: Vec<(Adoptable, OwnedFd)>,
    peer_pes: Vec<u8>,
) -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut fds = listeners;
    let mut adoptable = Vec::with_capacity(conns.len());
    for (a, fd) in conns {
        adoptable.push(a);
        fds.push(fd);
    }
    let state = State {
        server_id,
        enrp,
        status,
        conns: adoptable,
        peer_pes,
    };
    Ok((serde_json::to_vec(&state).map_err(io::Error::other)?, fds))
}
