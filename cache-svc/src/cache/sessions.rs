//! Holder sessions: open, touch (renew), keep-alive, close, expiry, and
//! reclaiming everything a session held.

use std::time::{Duration, Instant};

use super::Cache;
use crate::error::{Error, Result};
use crate::ids::{Epoch, SessionId};
use crate::pool::BlockState;
use crate::session::Session;

/// A session opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Opened {
    /// Its id.
    pub session_id: SessionId,
    /// The epoch to echo.
    pub epoch: Epoch,
    /// The TTL granted.
    pub ttl: Duration,
}

/// What closing (or expiring) a session gave back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reclaimed {
    /// The session.
    pub session_id: SessionId,
    /// Sequences it still held.
    pub sequences: u32,
    /// Blocks that returned to circulation.
    pub blocks: u64,
}

impl Cache {
    /// Opens a session; `ttl` None picks the default. The TTL is clamped.
    /// The per-holder session limit counts it under `holder`.
    pub fn open_session(
        &mut self,
        holder: &str,
        ttl: Option<Duration>,
        now: Instant,
    ) -> Result<Opened> {
        self.open_session_for(holder, holder, ttl, now)
    }

    /// [`Cache::open_session`], counted under `key` for the per-holder
    /// session limit (the caller's principal, where callers are known).
    pub fn open_session_for(
        &mut self,
        key: &str,
        holder: &str,
        ttl: Option<Duration>,
        now: Instant,
    ) -> Result<Opened> {
        super::check_name("holder", holder)?;
        let max = self.config.max_sessions;
        if max > 0 && self.sessions.len() >= max {
            return Err(Error::LimitExceeded(format!(
                "{} sessions are open, the service limit is {max}",
                self.sessions.len()
            )));
        }
        let per_key = self.config.max_sessions_per_holder;
        let held = self.sessions_per_key.get(key).copied().unwrap_or(0);
        if per_key > 0 && held >= per_key {
            return Err(Error::LimitExceeded(format!(
                "{key:?} has {held} sessions open, the limit per holder is {per_key}"
            )));
        }
        let ttl = ttl
            .unwrap_or(self.config.default_ttl)
            .clamp(self.config.min_ttl, self.config.max_ttl);
        let id = SessionId(self.next_session);
        self.next_session += 1;
        self.sessions
            .insert(id, Session::new(id, key.to_owned(), ttl, now));
        *self.sessions_per_key.entry(key.to_owned()).or_default() += 1;
        Ok(Opened {
            session_id: id,
            epoch: self.epoch,
            ttl,
        })
    }

    /// Checks a session's id and epoch; reclaims it if it has expired.
    pub(super) fn touch(
        &mut self,
        session_id: SessionId,
        epoch: Epoch,
        now: Instant,
    ) -> Result<()> {
        if epoch != self.epoch {
            return Err(Error::StaleEpoch {
                got: epoch,
                current: self.epoch,
            });
        }
        let session = self
            .sessions
            .get_mut(&session_id)
            .ok_or(Error::UnknownSession(session_id))?;
        if now >= session.expires_at {
            self.reclaim_session(session_id);
            return Err(Error::SessionExpired(session_id));
        }
        session.expires_at = now + session.ttl;
        Ok(())
    }

    /// Renews a session; returns the time left.
    pub fn keep_alive(
        &mut self,
        session_id: SessionId,
        epoch: Epoch,
        now: Instant,
    ) -> Result<Duration> {
        self.touch(session_id, epoch, now)?;
        Ok(self
            .sessions
            .get(&session_id)
            .map_or(Duration::ZERO, |s| s.ttl))
    }

    /// Closes a session, reclaiming everything it held.
    pub fn close_session(
        &mut self,
        session_id: SessionId,
        epoch: Epoch,
        now: Instant,
    ) -> Result<Reclaimed> {
        self.touch(session_id, epoch, now)?;
        Ok(self.reclaim_session(session_id))
    }

    /// Reclaims every session whose TTL ran out by `now`.
    pub fn expire_sessions(&mut self, now: Instant) -> Vec<Reclaimed> {
        let expired: Vec<SessionId> = self
            .sessions
            .values()
            .filter(|s| now >= s.expires_at)
            .map(|s| s.id)
            .collect();
        expired
            .into_iter()
            .map(|id| self.reclaim_session(id))
            .collect()
    }

    /// Gives back everything a session holds: live sequences (unfenced: the
    /// holder is gone), parked fences, and unpublished hashes (the steps that
    /// would have written them were never reported complete).
    fn reclaim_session(&mut self, session_id: SessionId) -> Reclaimed {
        let Some(mut session) = self.sessions.remove(&session_id) else {
            return Reclaimed::default();
        };
        if let Some(n) = self.sessions_per_key.get_mut(&session.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.sessions_per_key.remove(&session.key);
            }
        }
        let mut reclaimed = Reclaimed {
            session_id,
            ..Reclaimed::default()
        };
        for (_, seq) in session.seqs.drain() {
            reclaimed.sequences += 1;
            for t in &seq.tables {
                for beam in &t.beams {
                    for &b in &beam.blocks {
                        let pool = &mut self.pools[t.pool].pool;
                        pool.release(b, false);
                        if matches!(pool.state(b), BlockState::Free | BlockState::Cached) {
                            reclaimed.blocks += 1;
                        }
                    }
                }
            }
        }
        for (_, refs) in std::mem::take(&mut session.fences) {
            for r in refs {
                if self.pools[r.pool].pool.unfence(r.block) {
                    reclaimed.blocks += 1;
                }
            }
        }
        self.flush_events();
        reclaimed
    }
}
