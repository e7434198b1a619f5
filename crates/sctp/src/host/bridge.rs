//! A [`Host`] for an event loop that is not tokio's: the registrar's mio loop drives the
//! user-space [`Stack`](crate::Stack) itself, but the kernel's SCTP gives a socket per
//! association, which this runs on a thread of its own with tokio and reports as the stack
//! would — [`StackEvent`]s polled by the loop after a wake-up, and the same calls to listen,
//! connect, send, shut down and abort.
//!
//! Why a thread and not the loop's own sockets: one task per association already exists for
//! the library (`kernel_task.rs`); the loop gets that, message by message, without a second
//! kernel-SCTP driver. A registrar's SCTP traffic is a few messages per PE per keep-alive,
//! so the hand-over between threads costs little beside the system calls.

use super::{Association, Carrier, Host};
use crate::stack::{AssocId, StackEvent};
use bytes::Bytes;
use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;

enum Cmd {
    Listen(u16),
    Connect {
        id: AssocId,
        peer: SocketAddr,
        local_port: u16,
        peer_port: u16,
    },
    Send(AssocId, u16, u32, Bytes),
    Shutdown(AssocId),
    Abort(AssocId),
}

/// What an association's task is told.
enum ToAssoc {
    Send(u16, u32, Bytes),
    Shutdown,
    Abort,
}

/// Events for the loop, and how to wake it.
struct Events {
    queue: Mutex<VecDeque<StackEvent>>,
    wake: Box<dyn Fn() + Send + Sync>,
}

impl Events {
    fn push(&self, e: StackEvent) {
        self.queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(e);
        (self.wake)();
    }
}

type Routes = Arc<Mutex<HashMap<AssocId, mpsc::UnboundedSender<ToAssoc>>>>;

/// A host on a thread of its own; see the module's documentation.
pub struct Bridge {
    cmds: mpsc::UnboundedSender<Cmd>,
    local: SocketAddr,
    events: Arc<Events>,
    next: Arc<AtomicU64>,
}

impl Bridge {
    /// Starts a host for `carrier` on `local`; `wake` is called (on the host's thread) when
    /// events wait.
    pub fn start(
        carrier: Carrier,
        local: SocketAddr,
        wake: impl Fn() + Send + Sync + 'static,
    ) -> io::Result<Bridge> {
        let events = Arc::new(Events {
            queue: Mutex::new(VecDeque::new()),
            wake: Box::new(wake),
        });
        let next = Arc::new(AtomicU64::new(1));
        let (cmds, rx) = mpsc::unbounded_channel();
        let (started, ready) = std::sync::mpsc::channel();
        let (ev, ids) = (events.clone(), next.clone());
        std::thread::Builder::new()
            .name("sctp-host".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = started.send(Err(e));
                        return;
                    }
                };
                rt.block_on(async move {
                    match Host::start(carrier, local) {
                        Ok(host) => {
                            let _ = started.send(Ok(host.local_addr()));
                            run(host, rx, ev, ids).await;
                        }
                        Err(e) => {
                            let _ = started.send(Err(e));
                        }
                    }
                });
            })?;
        let local = ready
            .recv()
            .map_err(|_| io::Error::other("the SCTP host's thread ended"))??;
        Ok(Bridge {
            cmds,
            local,
            events,
            next,
        })
    }

    /// The host's local address (its UDP port bound).
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    fn cmd(&self, c: Cmd) {
        // The thread ends only with the bridge.
        let _ = self.cmds.send(c);
    }

    /// Accepts associations to SCTP port `port` (each reported as `Accepted`).
    pub fn listen(&self, port: u16) {
        self.cmd(Cmd::Listen(port));
    }

    /// Opens an association from `local_port` (0: any) to `peer_port` at `peer`: `Connected`
    /// or `Closed` follows.
    pub fn connect(&self, peer: SocketAddr, local_port: u16, peer_port: u16) -> AssocId {
        let id = AssocId(self.next.fetch_add(1, Ordering::Relaxed));
        self.cmd(Cmd::Connect {
            id,
            peer,
            local_port,
            peer_port,
        });
        id
    }

    pub fn send(&self, id: AssocId, stream: u16, ppid: u32, data: Bytes) {
        self.cmd(Cmd::Send(id, stream, ppid, data));
    }

    pub fn shutdown(&self, id: AssocId) {
        self.cmd(Cmd::Shutdown(id));
    }

    pub fn abort(&self, id: AssocId) {
        self.cmd(Cmd::Abort(id));
    }

    pub fn poll_event(&self) -> Option<StackEvent> {
        self.events
            .queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop_front()
    }
}

async fn run(
    host: Host,
    mut cmds: mpsc::UnboundedReceiver<Cmd>,
    events: Arc<Events>,
    next: Arc<AtomicU64>,
) {
    let host = Arc::new(host);
    let routes: Routes = Arc::default();
    while let Some(c) = cmds.recv().await {
        match c {
            Cmd::Listen(port) => match host.listen(port) {
                Ok(mut accepted) => {
                    let (events, routes, next) = (events.clone(), routes.clone(), next.clone());
                    tokio::spawn(async move {
                        while let Some(a) = accepted.recv().await {
                            let id = AssocId(next.fetch_add(1, Ordering::Relaxed));
                            events.push(StackEvent::Accepted {
                                id,
                                peer: a.peer(),
                                local_port: a.local_port(),
                                peer_port: a.peer_port(),
                            });
                            let (tx, rx) = mpsc::unbounded_channel();
                            lock(&routes).insert(id, tx);
                            tokio::spawn(carry(id, a, rx, events.clone(), routes.clone()));
                        }
                    });
                }
                Err(e) => tracing::warn!("SCTP: cannot listen on port {port}: {e}"),
            },
            Cmd::Connect {
                id,
                peer,
                local_port,
                peer_port,
            } => {
                // Messages sent before it is up wait in its channel.
                let (tx, rx) = mpsc::unbounded_channel();
                lock(&routes).insert(id, tx);
                let (host, events, routes) = (host.clone(), events.clone(), routes.clone());
                tokio::spawn(async move {
                    match host.connect(peer, local_port, peer_port).await {
                        Ok(a) => {
                            events.push(StackEvent::Connected(id));
                            carry(id, a, rx, events, routes).await;
                        }
                        Err(e) => {
                            lock(&routes).remove(&id);
                            events.push(StackEvent::Closed(id, Some(e.to_string())));
                        }
                    }
                });
            }
            Cmd::Send(id, stream, ppid, data) => {
                route(&routes, id, ToAssoc::Send(stream, ppid, data))
            }
            Cmd::Shutdown(id) => route(&routes, id, ToAssoc::Shutdown),
            Cmd::Abort(id) => route(&routes, id, ToAssoc::Abort),
        }
    }
}

fn lock(
    routes: &Routes,
) -> std::sync::MutexGuard<'_, HashMap<AssocId, mpsc::UnboundedSender<ToAssoc>>> {
    routes.lock().unwrap_or_else(|e| e.into_inner())
}

fn route(routes: &Routes, id: AssocId, c: ToAssoc) {
    if let Some(tx) = lock(routes).get(&id) {
        let _ = tx.send(c);
    }
}

/// Carries one association's messages both ways until it ends; its end is reported once.
async fn carry(
    id: AssocId,
    mut a: Association,
    mut rx: mpsc::UnboundedReceiver<ToAssoc>,
    events: Arc<Events>,
    routes: Routes,
) {
    let why = loop {
        tokio::select! {
            m = a.recv() => match m {
                Some(m) => events.push(StackEvent::Message(id, m)),
                None => break None,
            },
            c = rx.recv() => match c {
                Some(ToAssoc::Send(stream, ppid, data)) => {
                    if a.send(stream, ppid, data).is_err() {
                        break Some("the SCTP host stopped".to_string());
                    }
                }
                Some(ToAssoc::Abort) => {
                    a.abort();
                    break Some("aborted by this end".to_string());
                }
                // Dropping the handle shuts the association down gracefully.
                Some(ToAssoc::Shutdown) | None => break None,
            },
        }
    };
    lock(&routes).remove(&id);
    events.push(StackEvent::Closed(id, why));
}
