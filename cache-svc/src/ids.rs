//! The numbers the cache is handed, each its own type so that two adjacent
//! arguments cannot be swapped: a holder's session and the epoch it was
//! opened in, a sequence and a step. They print as the bare number (logs,
//! error messages). The gRPC edge (`convert`) wraps and unwraps them.

use std::fmt;

/// A block's index in its pool (and in the worker's KV arena).
pub type BlockId = u32;

macro_rules! id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(pub u64);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }
    };
}

id!(
    /// A holder's session, as `OpenSession` gave it out.
    SessionId
);
id!(
    /// One start of the cache service: calls that carry another are stale.
    Epoch
);
id!(
    /// A sequence, as its holder numbers it within its session.
    SeqId
);
id!(
    /// A holder's step: fences and hash publication key on it.
    Step
);

impl Step {
    /// The step after this one; none after `u64::MAX`, which completes
    /// everything (nothing lies after it).
    pub fn next(self) -> Option<Self> {
        self.0.checked_add(1).map(Self)
    }
}
