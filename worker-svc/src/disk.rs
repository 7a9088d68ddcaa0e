//! The disk tier: one file per block below the host tier, in a directory
//! of the worker's own, that survives the worker's restart.
//!
//! The cache owns the tier's state (which block holds which hash, which is
//! pending or pinned); this module only writes and reads files, and never
//! hands out K/V it cannot vouch for. A block file is
//!
//! ```text
//! header (64 bytes, little-endian)
//!   magic "KVLDISK1" | version u32 | fingerprint u64 | window u32 | block u32
//!   hash u64 | parent u64 | payload_len u64 | ledger_words u32
//!   body crc32 u32 (ledger and payload) | header crc32 u32 (of the 60 before)
//! ledger: ledger_words u64 (which slots of the block hold K/V)
//! payload: the block's K/V as the backend keeps it (every layer of the pool)
//! ```
//!
//! at `DIR/w{window}/{block}.kvb`, written to a temporary name and renamed,
//! so a reader sees a whole file or the old one. The `fingerprint` covers
//! the model (its shape, name and tokenizer), the KV element type and the
//! block geometry: a file of another model or layout is never read as
//! ours. A read checks the magic, version, fingerprint, window, block, the
//! hash the cache expects, both checksums and the lengths; a file that
//! fails any of them is deleted and answered as an error (a miss), never as
//! K/V. At start the tier scans its directory, keeps the files that verify
//! ([`DiskTier::held`], which the worker announces to the cache through
//! `Describe`) and deletes the rest. Plain buffered files (no `O_DIRECT`):
//! the page cache helps a re-read; a write is not fsynced, so a crash may
//! lose it, which the checksum turns into a miss.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

const MAGIC: &[u8; 8] = b"KVLDISK1";
const VERSION: u32 = 1;
/// Bytes of a block file's header.
pub const HEADER_BYTES: usize = 64;

/// A block file found and verified at start: `(block, hash, parent)` of
/// one pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    /// The disk block (file slot).
    pub block: u32,
    /// The prefix hash of its content.
    pub hash: u64,
    /// Its parent's hash.
    pub parent: u64,
}

/// One pool's files.
#[derive(Debug, Clone)]
struct PoolFiles {
    window: u32,
    dir: PathBuf,
    payload_bytes: usize,
    ledger_words: usize,
    held: Vec<Held>,
}

/// A block read back and verified: the slots that hold K/V and the K/V.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockData {
    /// The slot ledger's words of the block.
    pub ledger: Vec<u64>,
    /// The K/V bytes.
    pub payload: Vec<u8>,
}

/// The disk tier of every pool of one worker.
#[derive(Debug)]
pub struct DiskTier {
    fingerprint: u64,
    blocks: u32,
    pools: Vec<PoolFiles>,
}

/// The geometry of one pool's block files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolGeometry {
    /// The pool's window (its directory).
    pub window: u32,
    /// Bytes of one block's K/V.
    pub payload_bytes: usize,
    /// Words of one block's slot ledger.
    pub ledger_words: usize,
}

/// Bytes one block of every pool takes on disk.
pub fn bytes_per_block(pools: &[PoolGeometry]) -> u64 {
    pools
        .iter()
        .map(|p| (HEADER_BYTES + p.ledger_words * 8 + p.payload_bytes) as u64)
        .sum()
}

/// FNV-1a over `bytes`: the fingerprint of what a file's K/V depends on
/// (stable across builds and platforms, unlike `DefaultHasher`).
pub fn fingerprint(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn io(what: &str, path: &Path, e: std::io::Error) -> Error {
    Error::Disk(format!("{what} {}: {e}", path.display()))
}

impl DiskTier {
    /// Opens (creating it) the tier in `dir` with room for `bytes`: as many
    /// blocks of every pool as fit (the same count in each, like the host
    /// tier). Scans what is there: files that verify against `fingerprint`
    /// and the geometry are kept, the rest deleted. A budget too small for
    /// one block is a configuration error.
    pub fn open(dir: &Path, bytes: u64, fingerprint: u64, pools: &[PoolGeometry]) -> Result<Self> {
        let per_block = bytes_per_block(pools).max(1);
        let blocks = u32::try_from(bytes / per_block).unwrap_or(u32::MAX);
        if blocks == 0 {
            return Err(Error::Config(format!(
                "--disk-tier-bytes {bytes} holds no block: one block of every pool takes {per_block} bytes"
            )));
        }
        let mut tier = DiskTier {
            fingerprint,
            blocks,
            pools: Vec::with_capacity(pools.len()),
        };
        for g in pools {
            let pool_dir = dir.join(format!("w{}", g.window));
            fs::create_dir_all(&pool_dir).map_err(|e| io("creating", &pool_dir, e))?;
            tier.pools.push(PoolFiles {
                window: g.window,
                dir: pool_dir,
                payload_bytes: g.payload_bytes,
                ledger_words: g.ledger_words,
                held: Vec::new(),
            });
        }
        for pool in 0..tier.pools.len() {
            tier.pools[pool].held = tier.scan(pool)?;
        }
        Ok(tier)
    }

    /// Blocks per pool.
    pub fn blocks(&self) -> u32 {
        self.blocks
    }

    /// The verified files pool `pool` held at start.
    pub fn held(&self, pool: usize) -> &[Held] {
        self.pools.get(pool).map_or(&[], |p| &p.held)
    }

    fn path(&self, pool: usize, block: u32) -> Option<PathBuf> {
        let p = self.pools.get(pool)?;
        Some(p.dir.join(format!("{block}.kvb")))
    }

    /// Keeps the files of `pool` that verify, deletes the others (and
    /// leftover temporary files).
    fn scan(&self, pool: usize) -> Result<Vec<Held>> {
        let dir = &self.pools[pool].dir;
        let mut held = Vec::new();
        let entries = fs::read_dir(dir).map_err(|e| io("reading", dir, e))?;
        for entry in entries {
            let entry = entry.map_err(|e| io("reading", dir, e))?;
            let path = entry.path();
            let name = entry.file_name();
            let block = name
                .to_str()
                .and_then(|n| n.strip_suffix(".kvb"))
                .and_then(|n| n.parse::<u32>().ok());
            let verified = block
                .filter(|&b| b < self.blocks)
                .and_then(|b| self.verify_file(pool, b, None).ok().map(|(h, _)| h));
            match verified {
                Some(h) => held.push(h),
                None => {
                    tracing::info!(path = %path.display(), "disk tier: dropping a file that does not verify");
                    let _ = fs::remove_file(&path);
                }
            }
        }
        held.sort_by_key(|h| h.block);
        Ok(held)
    }

    /// Writes block `block` of `pool`: `ledger` and `payload` (the K/V of
    /// the host block spilled), holding `hash` after `parent`.
    pub fn write(
        &self,
        pool: usize,
        block: u32,
        (hash, parent): (u64, u64),
        ledger: &[u64],
        payload: &[u8],
    ) -> Result<()> {
        let (Some(p), Some(path)) = (self.pools.get(pool), self.path(pool, block)) else {
            return Err(Error::Disk(format!("pool {pool} has no disk tier")));
        };
        if block >= self.blocks
            || payload.len() != p.payload_bytes
            || ledger.len() != p.ledger_words
        {
            return Err(Error::Disk(format!(
                "disk block {block} of window {}: {} payload bytes and {} ledger words, the tier holds {} blocks of {} and {}",
                p.window,
                payload.len(),
                ledger.len(),
                self.blocks,
                p.payload_bytes,
                p.ledger_words
            )));
        }
        let mut bytes = Vec::with_capacity(HEADER_BYTES + ledger.len() * 8 + payload.len());
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&VERSION.to_le_bytes());
        bytes.extend_from_slice(&self.fingerprint.to_le_bytes());
        bytes.extend_from_slice(&p.window.to_le_bytes());
        bytes.extend_from_slice(&block.to_le_bytes());
        bytes.extend_from_slice(&hash.to_le_bytes());
        bytes.extend_from_slice(&parent.to_le_bytes());
        bytes.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        bytes.extend_from_slice(&(ledger.len() as u32).to_le_bytes());
        let mut body = crc32fast::Hasher::new();
        for w in ledger {
            body.update(&w.to_le_bytes());
        }
        body.update(payload);
        bytes.extend_from_slice(&body.finalize().to_le_bytes());
        let header_crc = crc32fast::hash(&bytes);
        bytes.extend_from_slice(&header_crc.to_le_bytes());
        debug_assert_eq!(bytes.len(), HEADER_BYTES);
        for w in ledger {
            bytes.extend_from_slice(&w.to_le_bytes());
        }
        bytes.extend_from_slice(payload);
        let tmp = path.with_extension("kvb.tmp");
        let mut f = fs::File::create(&tmp).map_err(|e| io("creating", &tmp, e))?;
        f.write_all(&bytes).map_err(|e| io("writing", &tmp, e))?;
        drop(f);
        fs::rename(&tmp, &path).map_err(|e| io("renaming", &tmp, e))
    }

    /// Reads block `block` of `pool`, which must hold `hash`. A file that
    /// is missing or fails verification is deleted and answered as an
    /// error naming why.
    pub fn read(&self, pool: usize, block: u32, hash: u64) -> Result<BlockData> {
        match self.verify_file(pool, block, Some(hash)) {
            Ok((_, data)) => Ok(data),
            Err(e) => {
                if let Some(path) = self.path(pool, block) {
                    let _ = fs::remove_file(path);
                }
                Err(e)
            }
        }
    }

    fn verify_file(&self, pool: usize, block: u32, want: Option<u64>) -> Result<(Held, BlockData)> {
        let (Some(p), Some(path)) = (self.pools.get(pool), self.path(pool, block)) else {
            return Err(Error::Disk(format!("pool {pool} has no disk tier")));
        };
        let bad = |why: &str| {
            Error::DiskBlock(format!("disk block {block} of window {}: {why}", p.window))
        };
        if block >= self.blocks {
            return Err(bad("out of range"));
        }
        let bytes = fs::read(&path).map_err(|e| bad(&format!("cannot be read: {e}")))?;
        if bytes.len() < HEADER_BYTES {
            return Err(bad("the file is truncated"));
        }
        let u32_at = |at: usize| {
            u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
        };
        let u64_at = |at: usize| {
            let mut b = [0; 8];
            b.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(b)
        };
        if &bytes[..8] != MAGIC || u32_at(8) != VERSION {
            return Err(bad("not a kvlease block file of this version"));
        }
        if crc32fast::hash(&bytes[..60]) != u32_at(60) {
            return Err(bad("the header checksum does not match"));
        }
        if u64_at(12) != self.fingerprint {
            return Err(bad(
                "written for another model or KV layout (fingerprint differs)",
            ));
        }
        if u32_at(20) != p.window || u32_at(24) != block {
            return Err(bad("the header names another pool or block"));
        }
        let (hash, parent) = (u64_at(28), u64_at(36));
        if want.is_some_and(|w| w != hash) {
            return Err(bad("holds another hash than the cache expects"));
        }
        let (payload_len, words) = (u64_at(44), u32_at(52) as usize);
        if payload_len != p.payload_bytes as u64 || words != p.ledger_words {
            return Err(bad("the header's lengths do not match the pool"));
        }
        let body = &bytes[HEADER_BYTES..];
        if body.len() != words * 8 + p.payload_bytes {
            return Err(bad("the file is truncated or too long"));
        }
        if crc32fast::hash(body) != u32_at(56) {
            return Err(bad("the payload checksum does not match"));
        }
        let ledger = body[..words * 8]
            .chunks_exact(8)
            .map(|c| {
                let mut b = [0; 8];
                b.copy_from_slice(c);
                u64::from_le_bytes(b)
            })
            .collect();
        Ok((
            Held {
                block,
                hash,
                parent,
            },
            BlockData {
                ledger,
                payload: body[words * 8..].to_vec(),
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GEOMETRY: PoolGeometry = PoolGeometry {
        window: 0,
        payload_bytes: 64,
        ledger_words: 1,
    };

    fn tier(dir: &Path, fingerprint: u64) -> DiskTier {
        DiskTier::open(
            dir,
            10 * bytes_per_block(&[GEOMETRY]),
            fingerprint,
            &[GEOMETRY],
        )
        .unwrap()
    }

    fn payload(seed: u8) -> Vec<u8> {
        (0..64)
            .map(|i| seed.wrapping_mul(31).wrapping_add(i))
            .collect()
    }

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "kvlease-disk-{name}-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        ));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn a_block_written_reads_back_whole_and_survives_a_reopen() {
        let dir = temp_dir("roundtrip");
        let t = tier(&dir, 7);
        assert_eq!(t.blocks(), 10);
        t.write(0, 3, (0xabc, 0x12), &[0b1011], &payload(1))
            .unwrap();
        let data = t.read(0, 3, 0xabc).unwrap();
        assert_eq!(data.payload, payload(1));
        assert_eq!(data.ledger, vec![0b1011]);
        let again = tier(&dir, 7);
        assert_eq!(
            again.held(0),
            &[Held {
                block: 3,
                hash: 0xabc,
                parent: 0x12
            }]
        );
        assert_eq!(again.read(0, 3, 0xabc).unwrap().payload, payload(1));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_corrupted_byte_is_a_miss_and_the_file_is_gone() {
        let dir = temp_dir("corrupt");
        let t = tier(&dir, 7);
        t.write(0, 1, (5, 0), &[1], &payload(2)).unwrap();
        let path = dir.join("w0/1.kvb");
        let mut bytes = fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x40;
        fs::write(&path, &bytes).unwrap();
        let err = t.read(0, 1, 5).unwrap_err();
        assert!(err.to_string().contains("payload checksum"), "{err}");
        assert!(!path.exists(), "a file that failed is deleted");
        assert!(t.read(0, 1, 5).is_err(), "and stays a miss");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_truncated_or_missing_file_or_another_hash_is_a_miss() {
        let dir = temp_dir("truncated");
        let t = tier(&dir, 7);
        t.write(0, 2, (9, 0), &[1], &payload(3)).unwrap();
        assert!(
            t.read(0, 2, 10)
                .unwrap_err()
                .to_string()
                .contains("another hash")
        );
        t.write(0, 2, (9, 0), &[1], &payload(3)).unwrap();
        let path = dir.join("w0/2.kvb");
        let bytes = fs::read(&path).unwrap();
        fs::write(&path, &bytes[..bytes.len() - 8]).unwrap();
        assert!(
            t.read(0, 2, 9)
                .unwrap_err()
                .to_string()
                .contains("truncated")
        );
        assert!(
            t.read(0, 4, 9)
                .unwrap_err()
                .to_string()
                .contains("cannot be read")
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_file_of_another_model_is_never_read_and_is_dropped_at_start() {
        let dir = temp_dir("fingerprint");
        tier(&dir, 7)
            .write(0, 0, (1, 0), &[1], &payload(4))
            .unwrap();
        let other = tier(&dir, 8);
        assert!(other.held(0).is_empty(), "not announced");
        assert!(!dir.join("w0/0.kvb").exists(), "deleted at start");
        tier(&dir, 7)
            .write(0, 0, (1, 0), &[1], &payload(4))
            .unwrap();
        let err = other.read(0, 0, 1).unwrap_err();
        assert!(err.to_string().contains("fingerprint"), "{err}");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn files_past_a_smaller_cap_and_stray_files_are_dropped_at_start() {
        let dir = temp_dir("cap");
        let t = tier(&dir, 7);
        t.write(0, 9, (1, 0), &[1], &payload(5)).unwrap();
        t.write(0, 0, (2, 0), &[1], &payload(6)).unwrap();
        fs::write(dir.join("w0/junk"), b"x").unwrap();
        let small = DiskTier::open(&dir, 5 * bytes_per_block(&[GEOMETRY]), 7, &[GEOMETRY]).unwrap();
        assert_eq!(small.blocks(), 5);
        assert_eq!(small.held(0).len(), 1);
        assert_eq!(small.held(0)[0].block, 0);
        assert!(!dir.join("w0/9.kvb").exists() && !dir.join("w0/junk").exists());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_budget_below_one_block_is_refused() {
        let dir = temp_dir("budget");
        let err = DiskTier::open(&dir, 10, 7, &[GEOMETRY]).unwrap_err();
        assert!(err.to_string().contains("--disk-tier-bytes"), "{err}");
        let _ = fs::remove_dir_all(&dir);
    }
}
