//! A worker's incarnation: what the cache does when the worker behind a
//! group starts again (its device and host memory lost, its disk tier's
//! files kept), and how the disk tier is taken from the worker.
//!
//! The holder registers the worker's incarnation (a number that differs on
//! every start of the worker process) with the group's pools. The first one
//! a group gets (a new group, or one an older holder registered without)
//! is adopted: its disk tiers are indexed from the worker's files, nothing
//! is forgotten (the cache cannot tell whether that worker restarted, as
//! before incarnations). When a later one differs from the one the group
//! was last registered with:
//! - every published device and host hash of the group is forgotten (their
//!   content is gone): cached blocks become free;
//! - each pool's disk tier is replaced by the one the worker describes, and
//!   what the worker found in its block files (each verified against its
//!   checksum and the model's fingerprint, see `worker-svc`'s `disk`) is
//!   published: a prefix evicted to disk survives the restart.
//!
//! Nothing a session still holds or waits on may be forgotten: a group with
//! a block in use or fenced, or a host or disk block pending (a copy the
//! earlier worker may or may not have run) or pinned, refuses the new
//! incarnation ([`Error::IncarnationBusy`]) until that session releases,
//! completes or ends (a scheduler killed with its worker: until its session
//! expires; the scheduler's start-up waits for that). The same
//! incarnation again (a scheduler restarted, its worker not) changes
//! nothing: the cache's index is newer than what the worker found at start.
//!
//! Nor may a new incarnation take a group while an open session has leased
//! in it: that session drives the current worker, and the registration is
//! another scheduler's worker under the same group name (two schedulers with
//! one `--pool-group-prefix`). Accepted, it would forget the first worker's
//! blocks, and each scheduler would be granted blocks the other's worker
//! wrote. Refused the same way (`IncarnationBusy`): a scheduler started
//! again after it was killed waits for its earlier session to expire. The
//! session the registration comes from (`RegisterPoolRequest.session_id`)
//! does not count: a holder may register its own worker's restart.

use foldhash::{HashSet, HashSetExt};

use super::Cache;
use crate::error::{Error, Result};
use crate::tier::{HostBlockId, HostTier};

/// The disk tier of one pool as the worker describes it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DiskPool {
    /// The pool's window.
    pub window: u32,
    /// Disk blocks (0: no disk tier).
    pub blocks: u32,
    /// Verified block files: `(block, hash, parent)`.
    pub held: Vec<(HostBlockId, u64, u64)>,
}

/// What registering an incarnation did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reindexed {
    /// The incarnation was new: disk tiers replaced.
    pub new_incarnation: bool,
    /// It replaced an earlier one: device and host memory forgotten.
    pub memory_forgotten: bool,
    /// Disk blocks published from the worker's files.
    pub disk_blocks_indexed: u64,
}

impl Cache {
    /// Registers worker incarnation `incarnation` of `group` (registered
    /// by `owner`, from its open session `by` when it names one) with the
    /// disk tiers `disks` (see the module doc). An incarnation 0 (an older
    /// holder) may name no disk tier and changes nothing. Everything is
    /// checked before anything changes.
    pub fn register_incarnation(
        &mut self,
        owner: &str,
        group: &str,
        incarnation: u64,
        disks: &[DiskPool],
        by: Option<crate::SessionId>,
    ) -> Result<Reindexed> {
        if let Some(session) = by {
            self.check_session_of(session, owner)?;
        }
        let pools = self
            .owned_group(group, owner, "register_pool")?
            .pools
            .clone();
        let mut slots = Vec::with_capacity(disks.len());
        for d in disks {
            let Some(&i) = pools.iter().find(|&&i| self.pools[i].window == d.window) else {
                return Err(Error::InvalidArgument(format!(
                    "disk tier of window {}: the group has no pool of that window",
                    d.window
                )));
            };
            let host_blocks = self.pools[i].pool.host().len();
            check_disk_pool(d, host_blocks, incarnation, self.config.max_pool_blocks)?;
            slots.push(i);
        }
        let current = self.groups.get(group).map_or(0, |g| g.incarnation);
        if incarnation == 0 || incarnation == current {
            return Ok(Reindexed::default());
        }
        let forget = current != 0;
        let busy: Vec<String> = pools
            .iter()
            .filter_map(|&i| {
                let pool = &self.pools[i].pool;
                let (c, h, d) = (pool.counts(), pool.host().counts(), pool.disk().counts());
                let quiet = c.in_use == 0
                    && c.fenced == 0
                    && pool.host().is_quiet()
                    && pool.disk().is_quiet();
                (!quiet).then(|| {
                    format!(
                        "pool {}: {} blocks in use, {} fenced, host {} pending {} pinned, disk {} pending {} pinned",
                        self.pools[i].id, c.in_use, c.fenced, h.pending, h.pinned, d.pending, d.pinned
                    )
                })
            })
            .collect();
        if forget && !busy.is_empty() {
            return Err(Error::IncarnationBusy {
                group: group.to_owned(),
                detail: format!(
                    "a new worker incarnation cannot forget what a session still holds or copies ({})",
                    busy.join("; ")
                ),
            });
        }
        // A session that leased in the group is driving the current worker:
        // another incarnation while it is open is another scheduler's worker
        // under the same group name, and each would be granted blocks the
        // other's worker wrote.
        if forget {
            let mut drivers: Vec<String> = self
                .sessions
                .values()
                .filter(|s| Some(s.id) != by && s.groups.contains(group))
                .map(|s| format!("session {} of holder {:?}", s.id, s.key))
                .collect();
            if !drivers.is_empty() {
                drivers.sort();
                return Err(Error::IncarnationBusy {
                    group: group.to_owned(),
                    detail: format!(
                        "{} leased in it under worker incarnation {current} and is still open: a pool group serves one worker, so two schedulers need group names of their own (--pool-group-prefix); a scheduler started again waits for its earlier session to close or expire",
                        drivers.join(", ")
                    ),
                });
            }
        }
        let mut indexed = 0u64;
        for &i in &pools {
            let pool = &mut self.pools[i].pool;
            if forget {
                pool.forget_memory();
            }
            pool.set_disk_tier(HostTier::disk(0));
        }
        for (d, &i) in disks.iter().zip(&slots) {
            let mut disk = HostTier::disk(d.blocks);
            indexed += u64::from(disk.index_held(&d.held));
            self.pools[i].pool.set_disk_tier(disk);
        }
        if let Some(g) = self.groups.get_mut(group) {
            g.incarnation = incarnation;
        }
        self.flush_events();
        tracing::info!(
            pool_group = group,
            incarnation,
            memory_forgotten = forget,
            disk_blocks_indexed = indexed,
            "new worker incarnation: disk tiers indexed"
        );
        Ok(Reindexed {
            new_incarnation: true,
            memory_forgotten: forget,
            disk_blocks_indexed: indexed,
        })
    }

    /// The current infos of the pools `infos` names (a new incarnation
    /// changes their disk tiers).
    pub fn pool_infos(&self, infos: &[super::PoolInfo]) -> Vec<super::PoolInfo> {
        infos
            .iter()
            .map(|i| match (i.pool_id as usize).checked_sub(1) {
                Some(index) if index < self.pools.len() => self.info(index),
                _ => *i,
            })
            .collect()
    }
}

/// Checks one pool's disk tier as a holder registers it (the pool's host
/// tier has `host_blocks`): a disk tier needs an incarnation and a host
/// tier, at most `max_blocks` blocks, and files of distinct blocks in
/// range. The edge checks it before the group is registered, so a bad one
/// changes nothing.
pub fn check_disk_pool(
    d: &DiskPool,
    host_blocks: u32,
    incarnation: u64,
    max_blocks: u32,
) -> Result<()> {
    {
        let w = d.window;
        if d.blocks == 0 && d.held.is_empty() {
            return Ok(());
        }
        if incarnation == 0 {
            return Err(Error::InvalidArgument(format!(
                "disk_blocks of window {w}: a disk tier needs a worker_incarnation"
            )));
        }
        if d.blocks > max_blocks {
            return Err(Error::InvalidArgument(format!(
                "disk_blocks of window {w} must be 0 to {max_blocks}, got {}",
                d.blocks
            )));
        }
        if host_blocks == 0 {
            return Err(Error::InvalidArgument(format!(
                "disk_blocks of window {w}: a disk tier needs a host tier (host_blocks > 0)"
            )));
        }
        let mut seen = HashSet::with_capacity(d.held.len());
        for &(block, _, _) in &d.held {
            if block >= d.blocks {
                return Err(Error::InvalidArgument(format!(
                    "disk_held of window {w}: block {block} is out of range (disk_blocks {})",
                    d.blocks
                )));
            }
            if !seen.insert(block) {
                return Err(Error::InvalidArgument(format!(
                    "disk_held of window {w}: block {block} is listed twice"
                )));
            }
        }
        Ok(())
    }
}
