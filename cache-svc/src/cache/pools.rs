//! Pool groups: registration and lookup.
//!
//! Registering a group costs time linear in its blocks (each block's slot,
//! its eviction entry, the host tier's). So that no registration holds the
//! cache while it builds, it comes in three parts:
//! [`Cache::plan_registration`] checks it against the cache (names,
//! geometry, ownership, the limits), [`NewGroup::build`] builds the pools
//! without the cache, and [`Cache::commit_registration`] checks again (the
//! cache may have changed meanwhile) and inserts them. The gRPC edge builds
//! outside its lock; [`Cache::register_pool_for`] does all three at once.

use foldhash::{HashSet, HashSetExt};

use super::{BLOCK_STATE_BYTES, Cache, Group, PoolEntry, peers};
use crate::error::{Error, Result};
use crate::eviction::PolicyKind;
use crate::pool::BlockPool;

/// Bytes of cache state of a pool of `num_blocks` device and `host_blocks`
/// host blocks evicting with `policy`.
fn pool_bytes(policy: PolicyKind, num_blocks: u32, host_blocks: u32) -> u64 {
    (u64::from(num_blocks) + u64::from(host_blocks)) * BLOCK_STATE_BYTES
        + policy.extra_bytes(num_blocks)
}

/// The most device blocks of one pool evicting with `policy` whose cache
/// state fits in `bytes` (the state only grows with the blocks).
fn blocks_within(policy: PolicyKind, bytes: u64) -> u32 {
    let (mut fits, mut over) = (0u32, u32::MAX);
    if pool_bytes(policy, 1, 0) > bytes {
        return 0;
    }
    while over - fits > 1 {
        let mid = fits + (over - fits) / 2;
        if pool_bytes(policy, mid, 0) <= bytes {
            fits = mid;
        } else {
            over = mid;
        }
    }
    fits
}

/// A registration checked against the cache.
#[derive(Debug)]
pub enum Registration {
    /// The group is registered with this geometry already: its pools.
    Already(Vec<PoolInfo>),
    /// A new group: build it, then commit it.
    New(NewGroup),
}

/// A new group's registration, checked, its pools not built yet.
#[derive(Debug)]
pub struct NewGroup {
    owner: String,
    group: String,
    tokens_per_block: u32,
    /// `(window, num_blocks, host_blocks)` per pool.
    pools: Vec<(u32, u32, u32)>,
    policy: PolicyKind,
    /// Share of each pool a tenant may hold under retention hints.
    retention_share: f64,
}

/// A new group with its pools built, to commit.
#[derive(Debug)]
pub struct BuiltGroup {
    new: NewGroup,
    pools: Vec<BlockPool>,
}

impl NewGroup {
    /// Builds the pools: the cost of a registration, linear in its blocks.
    /// Needs no cache, so a caller can run it without holding one.
    pub fn build(self) -> BuiltGroup {
        let pools = self
            .pools
            .iter()
            .map(|&(_, num_blocks, host_blocks)| {
                let quota = (f64::from(num_blocks) * self.retention_share) as u32;
                BlockPool::with_policy(num_blocks, self.policy.build(num_blocks as usize))
                    .with_host_tier(host_blocks)
                    .with_retention_quota(quota)
            })
            .collect();
        BuiltGroup { new: self, pools }
    }
}

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
    /// Blocks of the pool's host tier (0: none).
    pub host_blocks: u32,
    /// Blocks of the pool's disk tier (0: none).
    pub disk_blocks: u32,
}

/// What unregistering a group removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Unregistered {
    /// Pools removed.
    pub pools: u32,
    /// Their blocks.
    pub blocks: u64,
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

    /// Declares the pools of a group for the principal `anonymous` (see
    /// [`register_pool_for`](Self::register_pool_for)).
    pub fn register_pool(
        &mut self,
        group: &str,
        tokens_per_block: u32,
        pools: &[(u32, u32)],
    ) -> Result<(Vec<PoolInfo>, bool)> {
        let tiered: Vec<(u32, u32, u32)> = pools.iter().map(|&(w, n)| (w, n, 0)).collect();
        self.register_pool_for(
            kvlease_auth::principal::ANONYMOUS,
            group,
            tokens_per_block,
            &tiered,
        )
    }

    /// Declares the pools of a group: `(window, num_blocks, host_blocks)`
    /// per distinct window (`host_blocks` 0: no host tier). Returns the
    /// pools and whether they were already registered. The host blocks are
    /// part of the geometry: registering again with other counts is a
    /// conflict. The first registration binds the group to `owner`, the
    /// only principal whose sessions may `Match` or `Lease` in it
    /// (`owned_group`); registering it again as another
    /// principal is refused ([`Error::GroupNotOwned`]) rather than answered
    /// as a success that principal could never use.
    pub fn register_pool_for(
        &mut self,
        owner: &str,
        group: &str,
        tokens_per_block: u32,
        pools: &[(u32, u32, u32)],
    ) -> Result<(Vec<PoolInfo>, bool)> {
        match self.plan_registration(owner, group, tokens_per_block, pools)? {
            Registration::Already(infos) => Ok((infos, true)),
            Registration::New(new) => self.commit_registration(new.build()),
        }
    }

    /// Checks a registration (see [`register_pool_for`](Self::register_pool_for))
    /// without building or changing anything: the group's pools if it is
    /// registered with this geometry, else the new group to build.
    pub fn plan_registration(
        &self,
        owner: &str,
        group: &str,
        tokens_per_block: u32,
        pools: &[(u32, u32, u32)],
    ) -> Result<Registration> {
        super::check_name("pool_group", group)?;
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
        for &(window, num_blocks, host_blocks) in pools {
            if host_blocks > self.config.max_pool_blocks {
                return Err(Error::InvalidArgument(format!(
                    "host_blocks of window {window} must be 0 to {}, got {host_blocks}",
                    self.config.max_pool_blocks
                )));
            }
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
        if self.groups.contains_key(group) {
            // before the geometry: another principal learns nothing of it
            let existing = self.owned_group(group, owner, "register_pool")?;
            let have: Vec<(u32, u32, u32)> = existing
                .pools
                .iter()
                .map(|&i| {
                    let pool = &self.pools[i].pool;
                    (self.pools[i].window, pool.len(), pool.host().len())
                })
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
                .filter_map(|&(w, _, _)| {
                    existing
                        .pools
                        .iter()
                        .find(|&&i| self.pools[i].window == w)
                        .map(|&i| self.info(i))
                })
                .collect();
            return Ok(Registration::Already(infos));
        }
        self.check_pool_limits(owner, group, pools)?;
        Ok(Registration::New(NewGroup {
            owner: owner.to_owned(),
            group: group.to_owned(),
            tokens_per_block,
            pools: pools.to_vec(),
            policy: self.config.eviction.for_group(group),
            retention_share: self.config.retention_share,
        }))
    }

    /// Inserts a built group, checked again first: a registration of the
    /// same group (or of others, against the limits) may have come while it
    /// was built. The group registered meanwhile with this geometry is
    /// answered as already registered, and the built pools are dropped.
    pub fn commit_registration(&mut self, built: BuiltGroup) -> Result<(Vec<PoolInfo>, bool)> {
        let BuiltGroup { new, pools } = built;
        let plan =
            self.plan_registration(&new.owner, &new.group, new.tokens_per_block, &new.pools)?;
        if let Registration::Already(infos) = plan {
            return Ok((infos, true));
        }
        let mut indices = Vec::with_capacity(pools.len());
        for (&(window, _, _), pool) in new.pools.iter().zip(pools) {
            let index = self.pools.len();
            self.pools.push(PoolEntry {
                id: index as u32 + 1,
                group: new.group.clone(),
                window,
                tokens_per_block: new.tokens_per_block,
                pool,
                retired: false,
            });
            indices.push(index);
        }
        let infos = indices.iter().map(|&i| self.info(i)).collect();
        self.groups.insert(
            new.group,
            Group {
                tokens_per_block: new.tokens_per_block,
                owner: new.owner,
                pools: indices,
                incarnation: 0,
                policy: new.policy,
                peer: peers::PeerProfile::default(),
            },
        );
        Ok((infos, false))
    }

    /// The group `name`, refused unless the principal `principal`
    /// registered it (invariant 11: a session names only its own
    /// principal's groups, so no tenant can read, probe or exhaust another's
    /// cache). There is no admin override: an admin may close another's
    /// session, which only gives blocks back, but its own sessions lease and
    /// match in its own groups like any other. `op` names the call in the
    /// log line.
    pub(super) fn owned_group(
        &self,
        name: &str,
        principal: &str,
        op: &'static str,
    ) -> Result<&Group> {
        let group = self
            .groups
            .get(name)
            .ok_or_else(|| Error::UnknownGroup(name.to_owned()))?;
        if group.owner != principal {
            tracing::warn!(
                pool_group = name,
                principal,
                op,
                "pool group of another principal named; refused"
            );
            return Err(Error::GroupNotOwned {
                group: name.to_owned(),
                caller: principal.to_owned(),
            });
        }
        Ok(group)
    }

    /// Blocks of every registered (not retired) pool.
    pub fn registered_blocks(&self) -> u64 {
        self.pools
            .iter()
            .filter(|p| !p.retired)
            .map(|p| u64::from(p.pool.len()) + u64::from(p.pool.host().len()))
            .sum()
    }

    /// Bytes of cache state of every registered (not retired) pool: its
    /// blocks, device and host, at [`BLOCK_STATE_BYTES`], and what its
    /// eviction policy holds beyond that ([`PolicyKind::extra_bytes`]).
    pub fn registered_bytes(&self) -> u64 {
        self.groups
            .values()
            .flat_map(|g| g.pools.iter().map(move |&i| (g.policy, i)))
            .filter(|&(_, i)| !self.pools[i].retired)
            .map(|(policy, i)| {
                let pool = &self.pools[i].pool;
                pool_bytes(policy, pool.len(), pool.host().len())
            })
            .sum()
    }

    /// Blocks (device and host) of the groups `owner` registered.
    pub fn blocks_of(&self, owner: &str) -> u64 {
        self.groups
            .values()
            .filter(|g| g.owner == owner)
            .flat_map(|g| &g.pools)
            .map(|&i| {
                let pool = &self.pools[i].pool;
                u64::from(pool.len()) + u64::from(pool.host().len())
            })
            .sum()
    }

    /// Refuses `owner`'s new group over the group limits (all principals
    /// together, and each one's) or the block limits (the memory budget of
    /// all pools, and each principal's blocks), with the figures.
    fn check_pool_limits(&self, owner: &str, group: &str, pools: &[(u32, u32, u32)]) -> Result<()> {
        let max_groups = self.config.max_pool_groups;
        if max_groups > 0 && self.groups.len() >= max_groups {
            return Err(Error::LimitExceeded(format!(
                "{} pool groups are registered, the limit is {max_groups}; unregister one first",
                self.groups.len()
            )));
        }
        let per_principal = self.config.max_pool_groups_per_principal;
        let owned = self.groups.values().filter(|g| g.owner == owner).count();
        if per_principal > 0 && owned >= per_principal {
            return Err(Error::LimitExceeded(format!(
                "principal {owner} has registered {owned} pool groups, the limit per principal is {per_principal}; unregister one first"
            )));
        }
        let asked: u64 = pools
            .iter()
            .map(|&(_, n, host)| u64::from(n) + u64::from(host))
            .sum();
        let cap = self.config.max_blocks_per_principal;
        if cap > 0 {
            let have = self.blocks_of(owner);
            if have + asked > cap {
                return Err(Error::LimitExceeded(format!(
                    "pool group {group:?} asks for {asked} blocks; principal {owner} has {have} registered, {} in all is over the limit of {cap} blocks per principal ({} more fit)",
                    have + asked,
                    cap.saturating_sub(have)
                )));
            }
        }
        let budget = self.config.pool_memory_budget;
        if budget > 0 {
            let policy = self.config.eviction.for_group(group);
            let have = self.registered_bytes();
            let need: u64 = pools
                .iter()
                .map(|&(_, n, host)| pool_bytes(policy, n, host))
                .sum();
            if have + need > budget {
                let left = budget.saturating_sub(have);
                let per_block = need as f64 / asked.max(1) as f64;
                return Err(Error::LimitExceeded(format!(
                    "pool group {group:?} asks for {asked} blocks, {need} bytes of cache state with eviction policy {policy} ({per_block:.0} bytes a block); with the {have} bytes registered that is over the budget of {budget} bytes ({left} bytes left: {} more blocks fit in one such pool)",
                    blocks_within(policy, left)
                )));
            }
        }
        Ok(())
    }

    /// Removes a pool group whose blocks nobody holds: its pools' blocks
    /// (free and cached) are dropped and their ids are not reused. Refused
    /// with the figures while any block of it is leased or fenced. Takes no
    /// principal: it is an operator's act (`admin` only, by the
    /// authorization matrix) on any group, and it reads nothing of the
    /// group's cache.
    pub fn unregister_pool(&mut self, group: &str) -> Result<Unregistered> {
        super::check_name("pool_group", group)?;
        let Some(existing) = self.groups.get(group) else {
            return Err(Error::UnknownGroup(group.to_owned()));
        };
        let busy: Vec<String> = existing
            .pools
            .iter()
            .filter_map(|&i| {
                let c = self.pools[i].pool.counts();
                (c.in_use > 0 || c.fenced > 0).then(|| {
                    format!(
                        "pool {} has {} blocks in use and {} fenced",
                        self.pools[i].id, c.in_use, c.fenced
                    )
                })
            })
            .collect();
        if !busy.is_empty() {
            return Err(Error::GroupBusy {
                group: group.to_owned(),
                detail: busy.join(", "),
            });
        }
        let Some(removed) = self.groups.remove(group) else {
            return Err(Error::UnknownGroup(group.to_owned()));
        };
        let mut gone = Unregistered::default();
        for &i in &removed.pools {
            // Hashes still waiting on a session's step would publish into
            // blocks that no longer exist.
            for session in self.sessions.values_mut() {
                for refs in session.pending.values_mut() {
                    refs.retain(|r| r.pool != i);
                }
                for refs in session
                    .demotions
                    .values_mut()
                    .chain(session.host_pins.values_mut())
                {
                    refs.retain(|r| r.pool != i);
                }
            }
            let entry = &mut self.pools[i];
            gone.pools += 1;
            gone.blocks += u64::from(entry.pool.len());
            entry.pool = BlockPool::new(0);
            entry.retired = true;
        }
        Ok(gone)
    }

    pub(super) fn info(&self, index: usize) -> PoolInfo {
        let p = &self.pools[index];
        PoolInfo {
            pool_id: p.id,
            window: p.window,
            num_blocks: p.pool.len(),
            tokens_per_block: p.tokens_per_block,
            host_blocks: p.pool.host().len(),
            disk_blocks: p.pool.disk().len(),
        }
    }
}
