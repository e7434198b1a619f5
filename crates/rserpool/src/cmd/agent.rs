//! `serve --agent ADDR`: HAProxy's agent-check protocol, so that a HAProxy user gets
//! rserpool's view of a server without changing proxy. HAProxy connects to the agent every
//! `agent-inter`, reads one line and closes; the line's words set the server's state and its
//! weight relative to the configured one: here `up ready N%` while the target answers (N from
//! the credits, `credits / capacity`, or from the load reported for the RFC's adaptive
//! policies, `100 − load`; 100 otherwise; at least 1 % unless there is no credit at all),
//! `down` while it does not, and `drain` while an operator drained the PE (`rserpool drain`):
//! HAProxy then sends it no new work and lets what it has finish.

use rserpool_asap::CreditGauge;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tracing::{debug, warn};

/// What the agent says, kept up to date by `serve`.
#[derive(Clone, Debug)]
pub struct AgentState {
    healthy: Arc<AtomicBool>,
    drained: Arc<AtomicBool>,
    /// The weight in percent when there are no credits.
    percent: Arc<AtomicU32>,
    credits: Option<CreditGauge>,
}

impl AgentState {
    pub fn new(healthy: bool, credits: Option<CreditGauge>) -> Self {
        Self {
            healthy: Arc::new(AtomicBool::new(healthy)),
            drained: Arc::new(AtomicBool::new(false)),
            percent: Arc::new(AtomicU32::new(100)),
            credits,
        }
    }

    pub fn set_healthy(&self, healthy: bool) {
        self.healthy.store(healthy, Ordering::Relaxed);
    }

    pub fn set_drained(&self, drained: bool) {
        self.drained.store(drained, Ordering::Relaxed);
    }

    /// The share of the configured weight for a policy without credits (from a load).
    pub fn set_percent(&self, percent: u32) {
        self.percent.store(percent.min(100), Ordering::Relaxed);
    }

    /// The line HAProxy reads.
    pub fn reply(&self) -> String {
        if !self.healthy.load(Ordering::Relaxed) {
            return "down\n".into();
        }
        if self.drained.load(Ordering::Relaxed) {
            return "drain\n".into();
        }
        let percent = match &self.credits {
            Some(g) => {
                let (c, cap) = (u64::from(g.credits()), u64::from(g.capacity().max(1)));
                // Some credit never rounds down to nothing.
                ((c * 100 / cap) as u32).max(u32::from(c > 0))
            }
            None => self.percent.load(Ordering::Relaxed),
        };
        format!("up ready {percent}%\n")
    }
}

/// Binds the agent's listener.
pub async fn bind(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen for HAProxy's agent-check on {addr}: {e}"))
}

/// Answers every connection with one line, then closes it.
pub async fn run(listener: TcpListener, state: AgentState) {
    loop {
        let (mut s, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                warn!("agent-check: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let line = state.reply();
        debug!("agent-check from {peer}: {}", line.trim_end());
        tokio::spawn(async move {
            let write = async {
                s.write_all(line.as_bytes()).await?;
                s.shutdown().await
            };
            let _ = tokio::time::timeout(Duration::from_secs(1), write).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_follows_health_and_load() {
        let a = AgentState::new(true, None);
        assert_eq!(a.reply(), "up ready 100%\n");
        a.set_percent(40);
        assert_eq!(a.reply(), "up ready 40%\n");
        a.set_healthy(false);
        assert_eq!(a.reply(), "down\n");
        a.set_healthy(true);
        a.set_drained(true);
        assert_eq!(a.reply(), "drain\n");
    }
}
