//! Block hashes for prefix reuse.
//!
//! The hash of a full block chains its parent's hash, the cache salt and the
//! block's token ids, so equal hashes mean equal whole prefixes (up to 64-bit
//! collisions), and blocks of different salts never match. The hashes are
//! published on `WatchEvents`, so other processes must be able to recompute
//! them: the algorithm and the bytes are fixed (and documented in
//! `proto/kvlease/v1/cache.proto`), never `std`'s unspecified `DefaultHasher`:
//! - block hash = SipHash-1-3, keys (0, 0), over
//!   `parent (u64 LE) | salt hash (u64 LE) | token (u32 LE) ...`, with 0
//!   mapped to 1 (0 means "no parent");
//! - salt hash = 0 for the empty salt, else SipHash-1-3, keys (0, 0), over
//!   `byte length (u64 LE) | UTF-8 bytes`.
//!
//! A 64-bit hash is chosen for speed. An adversary who can choose prompts can
//! craft collisions; deployments that share a pool between mutually
//! distrusting tenants must give each tenant a secret `cache_salt`.

use std::hash::Hasher;

use siphasher::sip::SipHasher13;

/// Hash of a root block's (absent) parent.
pub const ROOT_PARENT: u64 = 0;

fn hasher() -> SipHasher13 {
    SipHasher13::new_with_keys(0, 0)
}

/// A stable hash of the cache salt (0 for no salt).
pub fn salt_hash(salt: &str) -> u64 {
    if salt.is_empty() {
        return 0;
    }
    let mut h = hasher();
    h.write(&(salt.len() as u64).to_le_bytes());
    h.write(salt.as_bytes());
    h.finish()
}

/// The hash of one full block.
pub fn block_hash(parent: u64, salt: u64, tokens: &[u32]) -> u64 {
    let mut h = hasher();
    h.write(&parent.to_le_bytes());
    h.write(&salt.to_le_bytes());
    for &t in tokens {
        h.write(&t.to_le_bytes());
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

    /// Values computed by an independent SipHash-1-3 over the documented
    /// byte encoding: `cache-svc/scripts/golden_hashes.py` (pure Python from
    /// the paper, checked against its test vector; `--check` compares its
    /// values with these). A change here breaks every consumer of the event
    /// stream.
    #[test]
    fn golden_values() {
        assert_eq!(salt_hash(""), 0);
        let salt = salt_hash("tenant-a");
        assert_eq!(salt, 0xfc1a_ea15_6524_87ec);
        let b1 = block_hash(ROOT_PARENT, 0, &[1, 2, 3, 4]);
        assert_eq!(b1, 0x44db_2712_680f_1fa6);
        assert_eq!(block_hash(b1, 0, &[5, 6, 7, 8]), 0x9a1f_fb34_44f7_63db);
        assert_eq!(
            block_hash(ROOT_PARENT, salt, &[1, 2, 3, 4]),
            0x6818_597b_fe72_a1dc
        );
        let long: Vec<u32> = (100..116).collect();
        assert_eq!(block_hash(ROOT_PARENT, 0, &long), 0xab9d_4a16_75e4_33ae);
        assert_eq!(
            chain(0, &[1, 2, 3, 4, 5, 6, 7, 8], 4),
            vec![0x44db_2712_680f_1fa6, 0x9a1f_fb34_44f7_63db]
        );
    }
}
