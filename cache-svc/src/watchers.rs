//! The WatchEvents streams open, counted against two limits: all principals
//! together, and each principal's own, so that one principal cannot take
//! every stream.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{Error, Result};

/// The streams open now.
#[derive(Debug, Default)]
struct Open {
    all: usize,
    by_principal: HashMap<String, usize>,
}

/// The limits and the streams open against them.
#[derive(Debug, Clone)]
pub(crate) struct WatchSlots {
    open: Arc<Mutex<Open>>,
    max: usize,
    max_per_principal: usize,
}

/// One open stream, counted while it lives.
#[derive(Debug)]
pub(crate) struct WatchSlot {
    open: Arc<Mutex<Open>>,
    principal: String,
}

fn lock(open: &Mutex<Open>) -> MutexGuard<'_, Open> {
    // counts only: a panic elsewhere leaves them whole
    open.lock().unwrap_or_else(|p| p.into_inner())
}

impl WatchSlots {
    /// At most `max` streams open, at most `max_per_principal` of them one
    /// principal's; 0 for no limit, as in the cache's other limits.
    pub(crate) fn new(max: usize, max_per_principal: usize) -> Self {
        Self {
            open: Arc::default(),
            max,
            max_per_principal,
        }
    }

    /// A slot for one of `principal`'s streams, or RESOURCE_EXHAUSTED with
    /// the figures of the limit it would pass.
    pub(crate) fn take(&self, principal: &str) -> Result<WatchSlot> {
        let mut open = lock(&self.open);
        if self.max > 0 && open.all >= self.max {
            return Err(Error::LimitExceeded(format!(
                "{} WatchEvents streams are open, the limit is {}",
                open.all, self.max
            )));
        }
        let mine = open.by_principal.get(principal).copied().unwrap_or(0);
        if self.max_per_principal > 0 && mine >= self.max_per_principal {
            return Err(Error::LimitExceeded(format!(
                "principal {principal} has {mine} WatchEvents streams open, the limit per principal is {}",
                self.max_per_principal
            )));
        }
        open.all += 1;
        *open.by_principal.entry(principal.to_owned()).or_default() += 1;
        Ok(WatchSlot {
            open: Arc::clone(&self.open),
            principal: principal.to_owned(),
        })
    }
}

impl Drop for WatchSlot {
    fn drop(&mut self) {
        let mut open = lock(&self.open);
        open.all = open.all.saturating_sub(1);
        if let Some(n) = open.by_principal.get_mut(&self.principal) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.by_principal.remove(&self.principal);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_principal_cannot_take_every_stream() {
        let slots = WatchSlots::new(4, 2);
        let a1 = slots.take("a").unwrap();
        let _a2 = slots.take("a").unwrap();
        let err = slots.take("a").unwrap_err().to_string();
        assert!(
            err.contains(
                "principal a has 2 WatchEvents streams open, the limit per principal is 2"
            ),
            "{err}"
        );
        // another principal still gets one, up to the global limit
        let _b1 = slots.take("b").unwrap();
        let _b2 = slots.take("b").unwrap();
        let err = slots.take("c").unwrap_err().to_string();
        assert!(
            err.contains("4 WatchEvents streams are open, the limit is 4"),
            "{err}"
        );
        // a stream that ends gives its slot back to its principal
        drop(a1);
        let _a3 = slots.take("a").unwrap();
    }

    #[test]
    fn zero_is_no_limit() {
        let unlimited = WatchSlots::new(0, 0);
        let held: Vec<WatchSlot> = (0..100).map(|_| unlimited.take("a").unwrap()).collect();
        assert_eq!(held.len(), 100);
        // either limit alone still holds
        let per_principal_only = WatchSlots::new(0, 1);
        let _a = per_principal_only.take("a").unwrap();
        assert!(per_principal_only.take("a").is_err());
        let _b = per_principal_only.take("b").unwrap();
        let global_only = WatchSlots::new(1, 0);
        let _c = global_only.take("c").unwrap();
        assert!(global_only.take("d").is_err());
    }
}
