//! How far a matrix product may spread: the one type the dense products
//! ([`crate::ops`]) and the packed quantised ones ([`crate::packed`]) share.
//! A leaf module, so that `ops -> model::weights -> packed` does not lead
//! back to `ops`.

/// Whether a matrix product may spread over the rayon pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Threads {
    /// On the calling thread only (inside an already-parallel task).
    One,
    /// Over every thread of the current rayon pool.
    Pool,
}
