//! Holder sessions: open, touch (renew), keep-alive, close, expiry, and
//! reclaiming everything a session held.

use std::sync::Arc;
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
    /// Opens a session for the principal `anonymous` (see [`open_session_for`](Self::open_session_for)).
    pub fn open_session(
        &mut self,
        holder: &str,
        ttl: Option<Duration>,
        now: Instant,
    ) -> Result<Opened> {
        self.open_session_for(kvlease_auth::principal::ANONYMOUS, holder, ttl, now)
    }

    /// Opens a session owned by the principal `owner`: only `owner` may use it
    /// ([`check_owner`](Self::check_owner)). `ttl` None picks the default; the TTL is clamped.
    /// The id is random (never 0): knowing one's own session id tells nothing about others'.
    /// The per-holder session limit counts it under `owner` (under `holder` for the
    /// anonymous principal of an unauthenticated loopback service).
    pub fn open_session_for(
        &mut self,
        owner: &str,
        holder: &str,
        ttl: Option<Duration>,
        now: Instant,
    ) -> Result<Opened> {
        super::check_name("holder", holder)?;
        let key = if owner == kvlease_auth::principal::ANONYMOUS {
            holder
        } else {
            owner
        };
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
        let id = loop {
            let id = SessionId(rand::random::<u64>());
            if id.0 != 0 && !self.sessions.contains_key(&id) {
                break id;
            }
        };
        self.sessions
            .insert(id, Session::new(id, owner.into(), key.to_owned(), ttl, now));
        *self.sessions_per_key.entry(key.to_owned()).or_default() += 1;
        Ok(Opened {
            session_id: id,
            epoch: self.epoch,
            ttl,
        })
    }

    /// Refuses `caller` the use of a session another principal opened, unless `may_override`
    /// (an admin closing it). An unknown session passes: the call itself then says so.
    pub fn check_owner(
        &self,
        session_id: SessionId,
        caller: &str,
        may_override: bool,
    ) -> Result<()> {
        match self.sessions.get(&session_id) {
            Some(s) if &*s.owner != caller && !may_override => Err(Error::NotOwner {
                session: session_id,
                caller: caller.to_string(),
            }),
            _ => Ok(()),
        }
    }

    /// Checks that `session_id` is open and `caller`'s.
    pub fn check_session_of(&self, session_id: SessionId, caller: &str) -> Result<()> {
        if *self.session_principal(session_id)? != *caller {
            return Err(Error::NotOwner {
                session: session_id,
                caller: caller.to_string(),
            });
        }
        Ok(())
    }

    /// The principal that opened `session_id`: the one whose groups its
    /// calls may name.
    pub(super) fn session_principal(&self, session_id: SessionId) -> Result<Arc<str>> {
        self.sessions
            .get(&session_id)
            .map(|s| Arc::clone(&s.owner))
            .ok_or(Error::UnknownSession(session_id))
    }

    /// Checks a session's id and epoch; reclaims it if it has expired.
    /// Every call of a session comes through here, so this is also where
    /// expired retention hints are dropped (before the call allocates).
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
        for entry in &mut self.pools {
            entry.pool.expire_hints(now);
        }
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
        Self::reclaim_tiers(&mut self.pools, &mut session);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::CacheConfig;

    #[test]
    fn sessions_are_random_and_only_their_owner_may_use_them() {
        let now = Instant::now();
        let mut cache = Cache::new(CacheConfig::default());
        let a = cache.open_session_for("alice", "h", None, now).unwrap();
        let b = cache.open_session_for("bob", "h", None, now).unwrap();
        assert_ne!(a.session_id.0, 0);
        assert_ne!(b.session_id.0, a.session_id.0 + 1, "ids are not sequential");
        cache.check_owner(a.session_id, "alice", false).unwrap();
        let err = cache.check_owner(a.session_id, "bob", false).unwrap_err();
        assert!(matches!(err, Error::NotOwner { .. }), "{err}");
        assert!(err.to_string().contains("bob may not use it"), "{err}");
        // an admin closing it passes; an unknown session is left to the call itself
        cache.check_owner(a.session_id, "ops", true).unwrap();
        cache.check_owner(SessionId(12345), "bob", false).unwrap();
        // the anonymous default of open_session
        let anon = cache.open_session("h", None, now).unwrap();
        cache
            .check_owner(anon.session_id, kvlease_auth::principal::ANONYMOUS, false)
            .unwrap();
    }
}
