//! A pool user many tasks share. [`PoolUser`] keeps one association to a registrar and a
//! cache, and each of its calls takes it whole (`&mut self`): a server handling requests on
//! many tasks would put it behind a lock and, holding the lock across
//! [`connect`](PoolUser::connect), make every task wait for one PE's connect timeout. This
//! handle is `Clone` and holds the pool user's lock only while it asks (resolution, reports),
//! never while it connects to a PE.

use crate::Error;
use crate::pool_user::{PoolUser, PoolUserConfig, Resolution, Resolver, connect_avoiding};
use rserpool_wire::{PoolElement, PoolHandle};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::Mutex;

/// A [`PoolUser`] for many tasks: clones share its registrar association and its cache.
#[derive(Clone)]
pub struct SharedPoolUser {
    pu: Arc<Mutex<PoolUser>>,
    connect_timeout: Duration,
}

impl SharedPoolUser {
    pub fn new(cfg: PoolUserConfig) -> std::io::Result<Self> {
        Ok(Self::from(PoolUser::new(cfg)?))
    }

    /// Resolves `handle`: from the cache when fresh, else at a registrar (other tasks' calls
    /// wait while a registrar is asked).
    pub async fn resolve(&self, handle: &PoolHandle) -> Result<Resolution, Error> {
        self.pu.lock().await.resolve(handle).await
    }

    /// Tells a registrar that a PE could not be reached and drops it from the cache.
    pub async fn report_unreachable(&self, handle: &PoolHandle, pe_id: u32) -> Result<(), Error> {
        self.pu.lock().await.report_unreachable(handle, pe_id).await
    }

    /// Connects to a PE of the pool as [`PoolUser::connect`] does; other tasks go on while it
    /// waits for a PE's connect.
    pub async fn connect(&self, handle: &PoolHandle) -> Result<(TcpStream, PoolElement), Error> {
        self.connect_avoiding(handle, &[]).await
    }

    /// [`connect`](Self::connect), but never to the PEs in `avoid`.
    pub async fn connect_avoiding(
        &self,
        handle: &PoolHandle,
        avoid: &[u32],
    ) -> Result<(TcpStream, PoolElement), Error> {
        connect_avoiding(&mut &*self, handle, avoid, self.connect_timeout).await
    }
}

impl From<PoolUser> for SharedPoolUser {
    fn from(pu: PoolUser) -> Self {
        Self {
            connect_timeout: pu.connect_timeout(),
            pu: Arc::new(Mutex::new(pu)),
        }
    }
}

impl Resolver for &SharedPoolUser {
    async fn resolve(&mut self, handle: &PoolHandle) -> Result<Resolution, Error> {
        SharedPoolUser::resolve(self, handle).await
    }
    async fn report_unreachable(&mut self, handle: &PoolHandle, pe_id: u32) {
        let _ = SharedPoolUser::report_unreachable(self, handle, pe_id).await;
    }
    async fn forget(&mut self, handle: &PoolHandle) {
        self.pu.lock().await.forget(handle);
    }
}
