//! Block hashes for prefix reuse.
//!
//! The hash of a full block chains its parent's hash, the cache salt and the
//! block's token ids, so equal hashes mean equal whole prefixes (up to 64-bit
//! collisions), and blocks of different salts never match. The hash is
//! SipHash-1-3 with zero keys over `parent (u64 LE) | salt hash (u64 LE) |
//! tokens (u32 LE each)`; consumers of the event stream can recompute it.
//!
//! A 64-bit hash is chosen for speed. An adversary who can choose prompts can
//! craft collisions; deployments that share a pool between mutually
//! distrusting tenants must give each tenant a secret `cache_salt`.

use std::hash::{DefaultHasher, Hash, Hasher};

/// Hash of a root block's (absent) parent.
pub const ROOT_PARENT: u64 = 0;

/// A stable hash of the cache salt (0 for no salt).
pub fn salt_hash(salt: &str) -> u64 {
    if salt.is_empty() {
        return 0;
    }
    let mut h = DefaultHasher::new();
    salt.as_bytes().hash(&mut h);
    h.finish()
}

/// The hash of one full block.
pub fn block_hash(parent: u64, salt: u64, tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    h.write_u64(parent);
    h.write_u64(salt);
    for &t in tokens {
        h.write_u32(t);
    }
    // 0 is reserved for "no parent".
    h.finish().max(1)
}

/// Hashes of every full block of `tokens`, parent first.
pub fn chain(salt: u64, tokens: &[u32], tokens_per_block: usize) -> Vec<u64> {
    let mut parent = ROOT_PARENT;
    tokens
        .chunks_exact(tokens_per_block)
        .map(|block| {
            parent = block_hash(parent, salt, block);
            parent
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chained_hashes_depend_on_the_whole_prefix_and_the_salt() {
        let a = chain(0, &[1, 2, 3, 4, 5, 6, 7, 8], 4);
        let b = chain(0, &[9, 2, 3, 4, 5, 6, 7, 8], 4);
        let c = chain(salt_hash("tenant"), &[1, 2, 3, 4, 5, 6, 7, 8], 4);
        assert_eq!(a.len(), 2);
        assert_ne!(a[1], b[1], "same last block, different parent");
        assert_ne!(a[0], c[0], "salt separates tenants");
        assert_eq!(
            a,
            chain(0, &[1, 2, 3, 4, 5, 6, 7, 8, 9], 4),
            "partial block ignored"
        );
    }
}
