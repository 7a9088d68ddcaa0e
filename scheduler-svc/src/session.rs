//! The scheduler's session at the cache service, in one place: which session
//! it holds ([`Session`]: id, epoch, TTL), whether the cache answered the
//! last call (`up`), whether the cache lost the session (`lost`: restart,
//! expiry, stale epoch). Every clone of the cache client shares one
//! [`SessionState`], and every call's answer updates it, so the step loop,
//! the keep-alive task and start-up see the same thing. (Renewing the session
//! and re-opening it after a loss are `keepalive.rs`: they call the client,
//! which reads this state.)

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::domain::{Epoch, SessionId};
use crate::error::{Error, Result};

/// The session this scheduler holds at the cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Session {
    pub id: SessionId,
    pub epoch: Epoch,
    pub ttl_ms: u64,
    /// The most entries the cache takes in one batched list (its
    /// `--max-batch`), as it answered `OpenSession`; 0 when it advertised
    /// none (a cache from before the field).
    pub max_batch: u32,
}

impl Session {
    /// The cache's batch limit, if it advertised one.
    pub(crate) fn batch_limit(&self) -> Option<usize> {
        (self.max_batch > 0).then_some(self.max_batch as usize)
    }
}

/// What every clone of a cache client knows about its session.
#[derive(Debug)]
pub(crate) struct SessionState {
    session: Mutex<Session>,
    up: AtomicBool,
    lost: AtomicBool,
}

impl Default for SessionState {
    fn default() -> Self {
        Self {
            session: Mutex::new(Session::default()),
            up: AtomicBool::new(true),
            lost: AtomicBool::new(false),
        }
    }
}

impl SessionState {
    /// The session in use.
    pub(crate) fn session(&self) -> Session {
        *self.session.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the last call reached the cache service.
    pub(crate) fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    /// Whether the cache lost the session: it must be re-opened (and the
    /// pools re-registered) before leases mean anything again.
    pub(crate) fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Relaxed)
    }

    /// A new session was opened; it replaces the one held.
    pub(crate) fn opened(&self, session: Session) {
        *self.session.lock().unwrap_or_else(|e| e.into_inner()) = session;
    }

    /// The session is usable again (re-opened, pools re-registered, live
    /// sequences dealt with).
    pub(crate) fn recovered(&self) {
        self.lost.store(false, Ordering::Relaxed);
    }

    /// Notes what one call's answer says about the cache and the session.
    pub(crate) fn saw(&self, answer: Result<(), &Error>) {
        match answer {
            Err(Error::CacheUnavailable(_)) => self.up.store(false, Ordering::Relaxed),
            Err(Error::SessionLost(_)) => {
                self.up.store(true, Ordering::Relaxed);
                self.lost.store(true, Ordering::Relaxed);
            }
            Ok(()) | Err(_) => self.up.store(true, Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_set_the_flags() {
        let s = SessionState::default();
        assert!(s.is_up() && !s.is_lost());
        s.saw(Err(&Error::CacheUnavailable("down".into())));
        assert!(!s.is_up() && !s.is_lost());
        s.saw(Err(&Error::SessionLost("stale epoch".into())));
        assert!(s.is_up() && s.is_lost());
        s.saw(Ok(()));
        assert!(s.is_lost(), "only a recovery clears a loss");
        s.recovered();
        assert!(!s.is_lost());
    }
}
