//! Pool groups: registration and lookup.

use foldhash::{HashSet, HashSetExt};

use super::{Cache, Group, PoolEntry};
use crate::error::{Error, Result};
use crate::pool::BlockPool;

/// A registered pool, as `RegisterPool` reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolInfo {
    /// Its id.
    pub pool_id: u32,
    /// Window (0 = full).
    pub window: u32,
    /// Blocks.
    pub num_blocks: u32,
    /// Tokens per block.
    pub tokens_per_block: u32,
}

impl Cache {
    /// The pools.
    pub fn pools(&self) -> &[PoolEntry] {
        &self.pools
    }

    /// The pool with `pool_id`.
    pub fn pool(&self, pool_id: u32) -> Option<&PoolEntry> {
        self.pools.get((pool_id as usize).checked_sub(1)?)
    }

    /// Declares the pools of a group: `(window, num_blocks)` per distinct
    /// window. Returns the pools and whether they were already registered.
    pub fn register_pool(
        &mut self,
        group: &str,
        tokens_per_block: u32,
        pools: &[(u32, u32)],
    ) -> Result<(Vec<PoolInfo>, bool)> {
        if group.is_empty() || group.len() > 128 {
            return Err(Error::InvalidArgument(
                "pool_group must be 1 to 128 characters".into(),
            ));
        }
        if tokens_per_block == 0 || tokens_per_block > 65_536 {
            return Err(Error::InvalidArgument(format!(
                "tokens_per_block must be 1 to 65536, got {tokens_per_block}"
            )));
        }
        if pools.is_empty() || pools.len() > 64 {
            return Err(Error::InvalidArgument(
                "pools must list 1 to 64 window sizes".into(),
            ));
        }
        let mut windows = HashSet::new();
        for &(window, num_blocks) in pools {
            if !windows.insert(window) {
                return Err(Error::InvalidArgument(format!(
                    "window {window} is listed twice"
                )));
            }
            if num_blocks == 0 || num_blocks > self.config.max_pool_blocks {
                return Err(Error::InvalidArgument(format!(
                    "num_blocks of window {window} must be 1 to {}, got {num_blocks}",
                    self.config.max_pool_blocks
                )));
            }
        }
        if let Some(existing) = self.groups.get(group) {
            let have: Vec<(u32, u32)> = existing
                .pools
                .iter()
                .map(|&i| (self.pools[i].window, self.pools[i].pool.len()))
                .collect();
            let mut want_sorted = pools.to_vec();
            want_sorted.sort_unstable();
            let mut have_sorted = have.clone();
            have_sorted.sort_unstable();
            if existing.tokens_per_block != tokens_per_block || want_sorted != have_sorted {
                return Err(Error::GeometryConflict {
                    group: group.to_owned(),
                    detail: format!(
                        "registered tokens_per_block {} and (window, blocks) {have:?}, asked {tokens_per_block} and {pools:?}",
                        existing.tokens_per_block
                    ),
                });
            }
            let infos = pools
                .iter()
                .filter_map(|&(w, _)| {
                    existing
                        .pools
                        .iter()
                        .find(|&&i| self.pools[i].window == w)
                        .map(|&i| self.info(i))
                })
                .collect();
            return Ok((infos, true));
        }
        let mut indices = Vec::with_capacity(pools.len());
        let policy = self.config.eviction.for_group(group);
        for &(window, num_blocks) in pools {
            let index = self.pools.len();
            self.pools.push(PoolEntry {
                id: index as u32 + 1,
                group: group.to_owned(),
                window,
                tokens_per_block,
                pool: BlockPool::with_policy(num_blocks, policy.build(num_blocks as usize)),
            });
            indices.push(index);
        }
        let infos = indices.iter().map(|&i| self.info(i)).collect();
        self.groups.insert(
            group.to_owned(),
            Group {
                tokens_per_block,
                pools: indices,
            },
        );
        Ok((infos, false))
    }

    pub(super) fn info(&self, index: usize) -> PoolInfo {
        let p = &self.pools[index];
        PoolInfo {
            pool_id: p.id,
            window: p.window,
            num_blocks: p.pool.len(),
            tokens_per_block: p.tokens_per_block,
        }
    }
}
