//! Keeping the scheduler's cache session: the keep-alive that renews it
//! every third of its TTL, and re-opening it (with the pools registered
//! again) after the cache lost it. The session's state itself is
//! `session.rs`.

use std::time::Duration;

use tokio::sync::watch;

use crate::client::CacheClient;
use crate::domain::GroupGeometry;
use crate::error::{Error, Result};
use crate::session::Session;

/// Renews the session every third of its TTL until `shutdown` turns true
/// (a lost session is flagged by the call itself).
pub(crate) async fn keep_alive(cache: CacheClient, mut shutdown: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            _ = renew_every_third_of_ttl(&cache) => {}
            _ = shutdown.changed() => return,
        }
        if *shutdown.borrow() {
            return;
        }
    }
}

/// Renews the session for as long as it is awaited (start-up runs it beside
/// warm-up, which may take longer than the TTL).
pub(crate) async fn keep_alive_while_awaited(cache: &CacheClient) -> std::convert::Infallible {
    loop {
        renew_every_third_of_ttl(cache).await;
    }
}

async fn renew_every_third_of_ttl(cache: &CacheClient) {
    let ttl = cache.session().ttl_ms.max(30);
    tokio::time::sleep(Duration::from_millis(ttl / 3)).await;
    match cache.keep_alive().await {
        Ok(_) => {}
        Err(Error::SessionLost(m)) => {
            tracing::warn!(message = %m, "keep-alive: cache session lost")
        }
        Err(e) => tracing::warn!(error = %e, "keep-alive failed"),
    }
}

/// Opens a new session after the cache lost the old one and registers
/// `groups`' pools again; returns the session and the groups with their new
/// pool ids. The session stays flagged lost until the caller has dealt with
/// the live sequences (`SessionState::recovered`).
pub(crate) async fn reopen(
    cache: &CacheClient,
    holder: &str,
    ttl_ms: u64,
    groups: &[GroupGeometry],
) -> Result<(Session, Vec<GroupGeometry>)> {
    let session = cache.open_session(holder, ttl_ms).await?;
    let mut groups = groups.to_vec();
    for group in &mut groups {
        let pools: Vec<(u32, u32, u32)> = group
            .pools
            .iter()
            .map(|p| (p.window, p.num_blocks, p.host_blocks))
            .collect();
        group.pools = cache
            // a restarted cache gets no disk tier (the files the worker
            // found at its start may have changed since): none until the
            // scheduler starts again
            .register_pool(
                &group.name,
                group.tokens_per_block,
                &pools,
                &crate::domain::WorkerTiers::default(),
                &group.peer,
            )
            .await
            .map_err(|e| {
                tracing::warn!(group = %group.name, error = %e, "re-registering pools failed");
                e
            })?;
    }
    Ok((session, groups))
}
