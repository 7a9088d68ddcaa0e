//! Peer pull: which groups are peers of which, and the run of a prompt's
//! blocks a peer holds on its device after what a lease reuses locally.
//!
//! Two groups are peers when the same principal registered both with the
//! same non-empty peer key (the model, its tokenizer fingerprint and KV
//! element type, as the holder writes them), the same tokens per block and
//! the same windows, with every pool's bytes per block known and equal:
//! then a block published under a hash in one holds the K/V the other
//! would compute for that hash. A lease never pulls from another
//! principal's group, so a pull tells no one of another tenant's prompt.

use super::{Cache, Group, check_name};
use crate::error::{Error, Result};
use crate::ids::BlockId;

/// What a group's blocks depend on beyond its geometry, for peer pull.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct PeerProfile {
    /// The peer key (empty: the group takes no part in peer pulls).
    pub(super) key: String,
    /// Bytes of one block, by window (0: unknown).
    pub(super) bytes: Vec<(u32, u64)>,
}

impl PeerProfile {
    pub(super) fn bytes_of(&self, window: u32) -> u64 {
        self.bytes
            .iter()
            .find(|(w, _)| *w == window)
            .map_or(0, |&(_, b)| b)
    }
}

/// The run of a prompt's blocks a peer group holds on its device.
#[derive(Clone, Debug)]
pub(super) struct PeerRun {
    /// The peer group.
    pub(super) group: String,
    /// One past the last block index it brings (the first is the lease's
    /// local reuse).
    pub(super) end: u32,
    /// Per pool of the leasing group, in its order: the peer's pool (an
    /// index into the cache's pools) and its blocks for the indices from
    /// `max(first held, local reuse)` to `end`.
    pub(super) pools: Vec<(usize, Vec<BlockId>)>,
    /// Bytes of all those blocks.
    pub(super) bytes: u64,
}

impl Cache {
    /// Sets the peer profile of `group` (registered by `owner`): its peer
    /// key and each window's bytes per block (`(window, bytes)`; a window
    /// left out is unknown). An empty key takes the group out of peer
    /// pulls.
    pub fn set_peer_profile(
        &mut self,
        owner: &str,
        group: &str,
        key: &str,
        bytes: &[(u32, u64)],
    ) -> Result<()> {
        if !key.is_empty() {
            check_name("peer_key", key)?;
        }
        let entry = self.owned_group(group, owner, "register_pool")?;
        if let Some(&(window, _)) = bytes
            .iter()
            .find(|(w, _)| !entry.pools.iter().any(|&i| self.pools[i].window == *w))
        {
            return Err(Error::InvalidArgument(format!(
                "bytes_per_block names window {window}, which group {group} has no pool of"
            )));
        }
        if let Some(g) = self.groups.get_mut(group) {
            g.peer = PeerProfile {
                key: key.to_owned(),
                bytes: bytes.to_vec(),
            };
        }
        Ok(())
    }

    /// Bytes of one block of each of `group`'s pools together, when every
    /// one is known.
    fn block_bytes(&self, group: &Group) -> Option<u64> {
        group.pools.iter().try_fold(0u64, |sum, &i| {
            match group.peer.bytes_of(self.pools[i].window) {
                0 => None,
                b => Some(sum.saturating_add(b)),
            }
        })
    }

    /// The peer groups of `group` (named `name`): same owner, same key,
    /// tokens per block, windows and bytes per block; for each, its pool
    /// of every window of `group`, in `group`'s pool order.
    pub(super) fn peers_of(&self, name: &str, group: &Group) -> Vec<(&str, Vec<usize>)> {
        if group.peer.key.is_empty() || self.block_bytes(group).is_none() {
            return Vec::new();
        }
        let mut peers: Vec<(&str, Vec<usize>)> = self
            .groups
            .iter()
            .filter(|(n, g)| {
                n.as_str() != name
                    && g.owner == group.owner
                    && g.peer.key == group.peer.key
                    && g.tokens_per_block == group.tokens_per_block
                    && g.pools.len() == group.pools.len()
            })
            .filter_map(|(n, g)| {
                let pools = group
                    .pools
                    .iter()
                    .map(|&i| {
                        let w = self.pools[i].window;
                        g.pools
                            .iter()
                            .copied()
                            .find(|&j| self.pools[j].window == w && !self.pools[j].retired)
                            .filter(|_| g.peer.bytes_of(w) == group.peer.bytes_of(w))
                    })
                    .collect::<Option<Vec<usize>>>()?;
                Some((n.as_str(), pools))
            })
            .collect();
        // one answer whatever the map's order
        peers.sort_unstable_by(|a, b| a.0.cmp(b.0));
        peers
    }

    /// The longest run of blocks after `local` (the blocks a lease in
    /// `group` reuses from its own device and tiers) that one peer group
    /// holds published on its device, up to `most` (never the block of the
    /// last prompt token): in every pool, the blocks the first computed
    /// token's window reaches. `None` when no peer brings a block.
    pub(super) fn peer_run(
        &self,
        name: &str,
        group: &Group,
        hashes: &[u64],
        local: u32,
        most: u32,
    ) -> Option<PeerRun> {
        let b = group.tokens_per_block;
        let mut best: Option<PeerRun> = None;
        for (peer, pools) in self.peers_of(name, group) {
            let mut end = most;
            'shrink: while end > local {
                for (&i, &j) in group.pools.iter().zip(&pools) {
                    let first = super::matching::first_block(self.pools[i].window, end, b);
                    for idx in (first.max(local)..end).rev() {
                        if self.pools[j].pool.lookup(hashes[idx as usize]).is_none() {
                            end = idx;
                            continue 'shrink;
                        }
                    }
                }
                break;
            }
            if end <= local || best.as_ref().is_some_and(|r| r.end >= end) {
                continue;
            }
            let mut bytes = 0u64;
            let mut run = Vec::with_capacity(pools.len());
            for (&i, &j) in group.pools.iter().zip(&pools) {
                let window = self.pools[i].window;
                let first = super::matching::first_block(window, end, b);
                let blocks: Vec<BlockId> = (first.max(local)..end)
                    .filter_map(|idx| self.pools[j].pool.lookup(hashes[idx as usize]))
                    .collect();
                bytes = bytes.saturating_add(
                    (blocks.len() as u64).saturating_mul(group.peer.bytes_of(window)),
                );
                run.push((j, blocks));
            }
            best = Some(PeerRun {
                group: peer.to_owned(),
                end,
                pools: run,
                bytes,
            });
        }
        best
    }
}
