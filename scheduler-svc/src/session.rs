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
    /// What the cache said when it lost the session (expired, stale epoch,
    /// unknown), kept for the answers of the requests that meet the loss.
    lost_why: Mutex<String>,
}

impl Default for SessionState {
    fn default() -> Self {
        Self {
            session: Mutex::new(Session::default()),
            up: AtomicBool::new(true),
            lost: AtomicBool::new(false),
            lost_why: Mutex::new(String::new()),
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

    /// What the cache said when it last lost the session.
    pub(crate) fn lost_why(&self) -> String {
        self.lost_why
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Why the scheduler has no usable session at the cache now: the cache
    /// lost it and it is not re-opened yet, or the cache cannot be reached;
    /// `None` while it has one.
    pub(crate) fn missing(&self) -> Option<String> {
        if self.is_lost() {
            Some(format!(
                "the cache lost it: {}; not re-opened yet",
                self.lost_why()
            ))
        } else if !self.is_up() {
            Some("the cache service cannot be reached".to_owned())
        } else {
            None
        }
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
            Err(Error::SessionLost(why)) => {
                why.clone_into(&mut self.lost_why.lock().unwrap_or_else(|e| e.into_inner()));
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

    #[test]
    fn a_missing_session_says_why() {
        let s = SessionState::default();
        assert_eq!(s.missing(), None);
        s.saw(Err(&Error::CacheUnavailable(
            "Lease: connection refused".into(),
        )));
        assert_eq!(
            s.missing().as_deref(),
            Some("the cache service cannot be reached")
        );
        s.saw(Err(&Error::SessionLost(
            "session expired: session 3 missed its keep-alive and was reclaimed".into(),
        )));
        assert_eq!(
            s.missing().as_deref(),
            Some(
                "the cache lost it: session expired: session 3 missed its keep-alive and was reclaimed; not re-opened yet"
            )
        );
        s.recovered();
        assert_eq!(s.missing(), None);
    }
}
